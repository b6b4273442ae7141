"""The calls an RL framework makes: report progress, set the phase, submit samples, get the drafter.

Best-effort and non-blocking. Every call validates its input (a bad argument raises ValueError, or
TypeError for a wrong kind of argument, at once, naming the argument — that is the caller's bug), so
what reaches the buffer always encodes and round-trips: no NaN/inf that JSON would turn into null, no
text that is not UTF-8, no name that would break a Redis key. A refused call leaves nothing behind.
Then the call only touches an in-memory buffer under a lock; a background thread writes to Redis
(scheduler/client_writer.py; the checks: scheduler/client_checks.py).
A dead or slow Redis never stalls a rollout: progress and phase coalesce (latest wins, retried),
samples go through a bounded queue and are dropped and counted when it is full or Redis refuses them.
`current_drafter()` returns a cached value the thread refreshes.

    from tailspec.scheduler import client
    c = client.connect("redis://127.0.0.1:6379/0", cluster="default", node="node0")
    c.set_phase("rollout", step=3, policy_version=3, policy_path="/ckpt/step3")
    c.report_progress("worker0", gpus=[0], active=12, finished=52, phase="rollout", step=3, total=64)
    c.submit_samples([{"prompt_ids": [...], "response_ids": [...], "reward": 1.0, "policy_version": 3}])
    version = c.current_drafter()  # DrafterVersion or None
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError
from tailspec.core import redis_conn, state
from tailspec.core.config import load_config
from tailspec.core.state import DrafterVersion, PhaseInfo, Progress, Sample
from tailspec.scheduler.client_checks import (
    check_count,
    check_finite,
    check_name,
    check_seconds,
    check_text,
    checked_sample,
    encodes,
    first_error,
)
from tailspec.scheduler.client_writer import ClientWriter
from tailspec.scheduler.held import HeldReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReclaimWait:
    """What `wait_reclaimed` saw: how long it waited, whether every lent GPU came back, and if not, which GPUs
    are still held and by whom ("node0:gpu1 held by session node0-g1-t3 (running, step 12)")."""

    waited_s: float
    reclaimed: bool
    held: tuple[str, ...] = ()
    error: str | None = None  # Redis unreachable: nothing could be checked


class TailspecClient(ClientWriter):
    """The calls (this module) and the background writer (scheduler/client_writer.py) over one buffer."""

    def __init__(
        self,
        redis_url: str,
        cluster: str = "default",
        node: str = "node0",
        queue_size: int = 4096,
        progress_ttl_s: float = 5.0,
        timeout_s: float = 0.5,
        refresh_s: float = 0.5,
        samples_maxlen: int = 100_000,
        samples_keep_versions: int = 8,
    ):
        check_name("cluster", cluster)
        check_name("node", node)
        for name, v in (("queue_size", queue_size), ("samples_maxlen", samples_maxlen),
                        ("samples_keep_versions", samples_keep_versions)):
            check_count(name, v, minimum=1)
        for name, v in (("progress_ttl_s", progress_ttl_s), ("timeout_s", timeout_s), ("refresh_s", refresh_s)):
            check_seconds(name, v, positive=True)
        if not isinstance(redis_url, str):
            raise TypeError(f"redis_url must be a str, got {type(redis_url).__name__}")
        try:  # before the writer thread starts: a refused client leaves nothing running
            self.r = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        except ValueError as e:
            raise ValueError(f"redis_url: {e}") from None
        try:  # a wrong password or TLS setting fails here, plainly; Redis down is the writer's to ride out
            redis_conn.check(self.r, redis_url)
        except redis_conn.RedisSetupError as e:
            self.r.close()
            raise redis_conn.RedisSetupError(f"redis_url: {e}") from None
        self._redis_url = redis_url
        self.cluster, self.node = cluster, node
        self.progress_ttl_s, self.refresh_s, self.queue_size = progress_ttl_s, refresh_s, queue_size
        self.samples_maxlen = samples_maxlen
        # The stream keeps the samples of the newest `samples_keep_versions` policy versions this client
        # wrote (XTRIM MINID), and never more than samples_maxlen entries (XADD MAXLEN ~): bounded either way.
        self.samples_keep_versions = samples_keep_versions
        self._version_first_id: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._progress: dict[str, Progress] = {}  # latest per worker, not yet written
        self._last_sent: dict[str, tuple[Progress, float]] = {}  # for keep-alive re-sends
        self._phase: PhaseInfo | None = None
        self._writing = False  # a batch is taken off the buffers and not yet written (flush waits for it too)
        self._samples: collections.deque[tuple[Sample, bytes]] = collections.deque()  # encoded once, at submit
        self.dropped: collections.Counter[str] = collections.Counter()
        self._dropped_unsynced: collections.Counter[str] = collections.Counter()
        self.sent = collections.Counter()
        self.errors = 0
        self._drafter: DrafterVersion | None = None
        self._phase_seen: PhaseInfo | None = None
        self._refreshed = threading.Event()
        self._last_refresh = 0.0
        self._held_reader = HeldReader(self.r, cluster)
        self._thread = threading.Thread(target=self._run, name="tailspec-client", daemon=True)
        self._thread.start()

    # -- the calls -----------------------------------------------------------------------------
    def report_progress(
        self,
        worker: str,
        gpus: list[int],
        active: int,
        finished: int,
        phase: str = "rollout",
        *,
        total: int = 0,
        step: int | None = None,
        tokens_done: int = 0,
        tokens_per_s: float = 0.0,
        remaining_s: float | None = None,
        node: str | None = None,
        mem_released: bool | None = None,
        free_mem: int | None = None,
    ) -> None:
        """The worker's latest state (coalesced: latest wins). The GPU-memory handshake: a worker that finished
        and released its GPU memory (vLLM `sleep`, KV cache freed, allocator cache emptied) says so with
        `mem_released=True` and, if it measured it, `free_mem` (bytes free on its GPU); a worker that reports
        `mem_released=False` is never lent before it reports True."""
        check_text("report_progress: worker", worker)
        if node is not None:
            check_name("report_progress: node", node)
        if isinstance(gpus, (str, bytes, Mapping)) or not isinstance(gpus, Iterable):
            raise TypeError(f"report_progress: gpus must be a list of GPU indices, got {type(gpus).__name__}")
        if step is None:
            known = self._phase or self._phase_seen
            step = known.step if known is not None else 0
        try:
            p = Progress(
                worker=worker,
                node=node or self.node,
                gpus=list(gpus),
                active=active,
                finished=finished,
                total=total,
                phase=phase,
                step=step,
                tokens_done=tokens_done,
                tokens_per_s=tokens_per_s,
                remaining_s=remaining_s,
                mem_released=mem_released,
                free_mem=free_mem,
                ts=time.time(),
            )
        except ValidationError as e:
            raise ValueError(f"report_progress: {first_error(e)}") from None
        for name in ("tokens_per_s", "remaining_s"):
            check_finite(f"report_progress: {name}", getattr(p, name))
        encodes("report_progress", p)
        with self._lock:
            self._progress[worker] = p
        self._wake.set()

    def set_phase(
        self, phase: str, step: int, policy_version: int = 0, policy_path: str | None = None
    ) -> None:
        if policy_path is not None:
            check_text("set_phase: policy_path", policy_path)
        try:
            info = PhaseInfo(
                phase=phase,
                step=step,
                started_at=time.time(),
                policy_version=policy_version,
                policy_path=policy_path,
            )
        except ValidationError as e:
            raise ValueError(f"set_phase: {first_error(e)}") from None
        encodes("set_phase", info)
        with self._lock:
            self._phase = info
            self._phase_seen = info
        self._wake.set()

    def submit_samples(self, samples: Iterable[Sample | dict]) -> int:
        """Queue samples; returns how many were accepted (the rest were dropped and counted). All or nothing:
        one bad sample raises (naming its index and field) before any of the call's samples is queued."""
        if isinstance(samples, (str, bytes, Mapping, Sample)) or not isinstance(samples, Iterable):
            raise TypeError(f"submit_samples: samples must be a list of Sample or dict, got {type(samples).__name__}")
        good = [checked_sample(i, s) for i, s in enumerate(samples)]
        accepted = 0
        with self._lock:
            for s in good:
                if len(self._samples) >= self.queue_size:
                    self._drop("client_queue_full")
                else:
                    self._samples.append(s)
                    accepted += 1
        self._wake.set()
        return accepted

    def current_drafter(self, wait_s: float = 0.2) -> DrafterVersion | None:
        """The promoted drafter version (cached, refreshed every refresh_s); waits at most wait_s for
        the very first read."""
        check_seconds("current_drafter: wait_s", wait_s)
        if not self._refreshed.is_set():
            self._wake.set()
            self._refreshed.wait(wait_s)
        return self._drafter

    def wait_reclaimed(self, timeout_s: float = 15.0, poll_s: float = 0.01) -> ReclaimWait:
        """Block until every GPU lent to drafter training is back: every session ended or released its GPU
        (its final record, written after its memory is freed, or its record's `released_at`: the state its last
        merge writes is on the host; the scheduler writes a record for a killed session), and no GPU lent or
        reclaiming except by such a session (the scheduler marks those at its next tick). Call it after
        `set_phase("train", …)` and before the optimizer step needs the GPUs. A revoked GPU counts as reclaimed
        at the scheduler's stop deadline, but a session still training there would take the GPU from the update,
        so sessions are waited for too. Returns how long it waited; on timeout,
        which GPUs are still held and by whom (and logs a warning). Never raises: on a Redis error it
        returns with `error` set, after at most 2 s spent flushing this client's queue, so an outage never
        stalls training for longer."""
        check_seconds("wait_reclaimed: timeout_s", timeout_s)
        check_seconds("wait_reclaimed: poll_s", poll_s, positive=True)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        flushed = self.flush(min(timeout_s, 2.0))  # our own set_phase must be written before we look
        while True:
            try:
                held = self._held()
            except Exception as e:  # noqa: BLE001 — any client error: report it, do not block training
                return ReclaimWait(time.monotonic() - t0, False, (), f"{type(e).__name__}: {e}")
            if not held:
                return ReclaimWait(time.monotonic() - t0, True)
            if time.monotonic() >= deadline:
                log.warning("tailspec: %d GPU(s) not back %.1fs after the phase ended%s: %s", len(held), timeout_s,
                            "" if flushed else " (the phase change was not written yet)", "; ".join(held))
                return ReclaimWait(time.monotonic() - t0, False, tuple(held))
            time.sleep(poll_s)

    def _held(self) -> list[str]:
        """What still holds a lent GPU (scheduler/held.py: one round trip a poll, whatever the run's age)."""
        return self._held_reader.held()

    def current_phase(self) -> PhaseInfo | None:
        return self._phase_seen

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued was written (or dropped); True if the buffers are empty."""
        check_seconds("flush: timeout_s", timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                empty = not self._progress and self._phase is None and not self._samples and not self._writing
            if empty:
                return True
            self._wake.set()
            time.sleep(0.005)
        return False

    def close(self, flush_s: float = 1.0) -> None:
        self.flush(flush_s)
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=2)
        try:
            self.r.close()
        except Exception:
            pass


_default: TailspecClient | None = None
_default_lock = threading.Lock()


def connect(
    redis_url: str | None = None, cluster: str | None = None, node: str | None = None, **kw: Any
) -> TailspecClient:
    """Create (or replace) the process-wide client; missing arguments come from the tailspec config
    (TAILSPEC_CONFIG / TAILSPEC_* environment)."""
    global _default
    if redis_url is None or cluster is None or node is None:
        cfg = load_config()
        redis_url = redis_url or cfg.cluster.redis_url
        cluster = cluster or cfg.cluster.name
        node = node or os.environ.get("TAILSPEC_NODE") or cfg.cluster.node
        kw.setdefault("progress_ttl_s", cfg.scheduler.progress_ttl_s)
    with _default_lock:
        if _default is not None:
            _default.close(flush_s=0.2)
        _default = TailspecClient(redis_url, cluster, node, **kw)
    return _default


def default_client() -> TailspecClient:
    with _default_lock:
        have = _default
    return have if have is not None else connect()


def report_progress(
    worker: str, gpus: list[int], active: int, finished: int, phase: str = "rollout", **kw: Any
) -> None:
    default_client().report_progress(worker, gpus, active, finished, phase, **kw)


def set_phase(phase: str, step: int, policy_version: int = 0, policy_path: str | None = None) -> None:
    default_client().set_phase(phase, step, policy_version, policy_path)


def submit_samples(samples: Iterable[Sample | dict]) -> int:
    return default_client().submit_samples(samples)


def current_drafter() -> DrafterVersion | None:
    return default_client().current_drafter()
