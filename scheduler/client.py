"""The calls an RL framework makes: report progress, set the phase, submit samples, get the drafter.

Best-effort and non-blocking. Every call validates its input (a bad argument raises ValueError, or
TypeError for a wrong kind of argument, at once, naming the argument — that is the caller's bug), so
what reaches the buffer always encodes and round-trips: no NaN/inf that JSON would turn into null, no
text that is not UTF-8, no name that would break a Redis key. A refused call leaves nothing behind.
Then the call only touches an in-memory buffer under a lock; a background thread writes to Redis.
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
import math
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from tailspec.core import redis_conn, state
from tailspec.core.state import DrafterVersion, Event, PhaseInfo, Progress, Sample

log = logging.getLogger(__name__)

MAX_SAMPLE_IDS = 1 << 20  # prompt + response ids of one sample: far above any RL context, far below Redis' limits
MAX_TEXT = 4096  # characters of a worker name, group id or policy path
_NAME = re.compile(state.NAME_PATTERN)


@dataclass(frozen=True)
class ReclaimWait:
    """What `wait_reclaimed` saw: how long it waited, whether every lent GPU came back, and if not, which GPUs
    are still held and by whom ("node0:gpu1 held by session node0-g1-t3 (running, step 12)")."""

    waited_s: float
    reclaimed: bool
    held: tuple[str, ...] = ()
    error: str | None = None  # Redis unreachable: nothing could be checked


class TailspecClient:
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
        import redis

        _check_name("cluster", cluster)
        _check_name("node", node)
        for name, v in (("queue_size", queue_size), ("samples_maxlen", samples_maxlen),
                        ("samples_keep_versions", samples_keep_versions)):
            _check_count(name, v, minimum=1)
        for name, v in (("progress_ttl_s", progress_ttl_s), ("timeout_s", timeout_s), ("refresh_s", refresh_s)):
            _check_seconds(name, v, positive=True)
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
        _check_text("report_progress: worker", worker)
        if node is not None:
            _check_name("report_progress: node", node)
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
            raise ValueError(f"report_progress: {_first_error(e)}") from None
        for name in ("tokens_per_s", "remaining_s"):
            _check_finite(f"report_progress: {name}", getattr(p, name))
        _encodes("report_progress", p)
        with self._lock:
            self._progress[worker] = p
        self._wake.set()

    def set_phase(
        self, phase: str, step: int, policy_version: int = 0, policy_path: str | None = None
    ) -> None:
        if policy_path is not None:
            _check_text("set_phase: policy_path", policy_path)
        try:
            info = PhaseInfo(
                phase=phase,
                step=step,
                started_at=time.time(),
                policy_version=policy_version,
                policy_path=policy_path,
            )
        except ValidationError as e:
            raise ValueError(f"set_phase: {_first_error(e)}") from None
        _encodes("set_phase", info)
        with self._lock:
            self._phase = info
            self._phase_seen = info
        self._wake.set()

    def submit_samples(self, samples: Iterable[Sample | dict]) -> int:
        """Queue samples; returns how many were accepted (the rest were dropped and counted). All or nothing:
        one bad sample raises (naming its index and field) before any of the call's samples is queued."""
        if isinstance(samples, (str, bytes, Mapping, Sample)) or not isinstance(samples, Iterable):
            raise TypeError(f"submit_samples: samples must be a list of Sample or dict, got {type(samples).__name__}")
        good = [_checked_sample(i, s) for i, s in enumerate(samples)]
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
        _check_seconds("current_drafter: wait_s", wait_s)
        if not self._refreshed.is_set():
            self._wake.set()
            self._refreshed.wait(wait_s)
        return self._drafter

    def wait_reclaimed(self, timeout_s: float = 15.0, poll_s: float = 0.05) -> ReclaimWait:
        """Block until every GPU lent to drafter training is back: no GPU lent or reclaiming, and every
        session process ended (its final record written; the scheduler writes one for a killed session).
        Call it after `set_phase("train", …)` and before the optimizer step needs the GPUs. A revoked GPU
        counts as reclaimed at the scheduler's stop deadline, but a session still merging there would take
        compute from the update, so sessions are waited for too. Returns how long it waited; on timeout,
        which GPUs are still held and by whom (and logs a warning). Never raises: on a Redis error it
        returns with `error` set, after at most 2 s spent flushing this client's queue, so an outage never
        stalls training for longer."""
        _check_seconds("wait_reclaimed: timeout_s", timeout_s)
        _check_seconds("wait_reclaimed: poll_s", poll_s, positive=True)
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
        held = []
        for m in sorted(self.r.smembers(state.key(self.cluster, "gpus"))):
            node, gpu = m.decode().split(":")
            st = state.get(self.r, state.key(self.cluster, "gpu_status", node=node, gpu=int(gpu)), state.GpuStatus)
            if st is not None and st.state in (state.GpuState.LENT, state.GpuState.RECLAIMING):
                who = f"session {st.session_id}" if st.session_id else f"lease {st.lease_token}"
                held.append(f"{node}:gpu{gpu} {st.state.value} by {who}")
        keys = [state.key(self.cluster, "session", session_id=sid.decode())
                for sid in sorted(self.r.smembers(state.key(self.cluster, "sessions")))]
        for key, raw in zip(keys, self.r.mget(keys) if keys else []):
            try:
                info = None if raw is None else state.decode(state.SessionInfo, raw, where=key)
            except state.StateError as e:  # one bad record must not make the trainer wait for nothing
                log.warning("tailspec: skipping %s", e)
                continue
            if info is not None and info.status not in ("stopped", "failed"):
                held.append(f"{info.node}:gpu{info.gpu} held by session {info.session_id} ({info.status}, "
                            f"step {info.step})")
        return held

    def current_phase(self) -> PhaseInfo | None:
        return self._phase_seen

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued was written (or dropped); True if the buffers are empty."""
        _check_seconds("flush: timeout_s", timeout_s)
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

    # -- background writer ---------------------------------------------------------------------
    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] += n
        self._dropped_unsynced[reason] += n

    def _run(self) -> None:
        backoff = 0.0
        while not self._closed.is_set():
            self._wake.wait(timeout=max(backoff, min(self.refresh_s, self.progress_ttl_s / 3)))
            self._wake.clear()
            if backoff and self._closed.wait(backoff):  # Redis failing: space the retries
                break
            try:
                self._write_once()
                backoff = 0.0
            except Exception as e:  # Redis down or slow: keep the latest progress/phase, retry later
                self.errors += 1
                backoff = min(1.0, max(0.05, backoff * 2))
                if self.errors in (1, 10) or self.errors % 100 == 0:
                    log.warning(
                        "tailspec client: Redis write failed (%s); %d errors, dropped %s",
                        redis_conn.explain(e, self._redis_url) or e,
                        self.errors,
                        dict(self.dropped),
                    )

    def _write_once(self) -> None:
        try:
            self._write_batch()
        finally:
            with self._lock:
                self._writing = False

    def _write_batch(self) -> None:
        c = self.cluster
        now = time.time()
        with self._lock:
            progress, self._progress = self._progress, {}
            phase, self._phase = self._phase, None
            n = min(len(self._samples), 1000)
            samples = [self._samples.popleft() for _ in range(n)]
            dropped, self._dropped_unsynced = self._dropped_unsynced, collections.Counter()
            self._writing = True
        # keep-alive: re-send each worker's last report before its key expires
        for w, (p, sent_at) in self._last_sent.items():
            if w not in progress and now - sent_at > self.progress_ttl_s / 3:
                progress[w] = p
        pipe = self.r.pipeline(transaction=False)
        if phase is not None:
            pipe.set(state.key(c, "phase"), state.encode(phase))
            pipe.xadd(
                state.key(c, "events"),
                {
                    "data": state.encode(
                        Event(
                            kind="phase",
                            detail={
                                "phase": phase.phase,
                                "step": phase.step,
                                "policy_version": phase.policy_version,
                            },
                        )
                    )
                },
                maxlen=20_000,
                approximate=True,
            )
        px = int(self.progress_ttl_s * 1000)
        for w, p in progress.items():
            pipe.set(state.key(c, "progress", worker=w), state.encode(p), px=px)
            pipe.sadd(state.key(c, "workers"), w)
        first_sample = len(pipe.command_stack)
        for _, data in samples:
            pipe.xadd(
                state.key(c, "samples"),
                {"data": data},
                maxlen=self.samples_maxlen,
                approximate=True,
            )
        for reason, k in dropped.items():
            pipe.hincrby(state.key(c, "dropped"), reason, k)
        refresh = now - self._last_refresh >= self.refresh_s or not self._refreshed.is_set()
        if refresh:
            pipe.get(state.key(c, "drafter_current"))
            pipe.get(state.key(c, "phase"))
        try:
            res = pipe.execute()
        except Exception:
            with self._lock:  # progress and phase: newest wins, so put back only what was not replaced
                for w, p in progress.items():
                    self._progress.setdefault(w, p)
                if phase is not None and self._phase is None:
                    self._phase = phase
                for reason, k in dropped.items():
                    self._dropped_unsynced[reason] += k
            if samples:
                self._drop("redis_unavailable", len(samples))
            raise
        for w, p in progress.items():
            self._last_sent[w] = (p, now)
        self.sent["progress"] += len(progress)
        self.sent["samples"] += len(samples)
        if samples:
            self._trim_versions(samples, res[first_sample : first_sample + len(samples)])
        if refresh:
            self._last_refresh = now
            raw_drafter, raw_phase = res[-2], res[-1]
            try:
                self._drafter = None if raw_drafter is None else state.decode(DrafterVersion, raw_drafter)
            except state.StateError:
                self._drop("bad_drafter_record")
            try:
                if raw_phase is not None:
                    self._phase_seen = state.decode(PhaseInfo, raw_phase)
            except state.StateError:
                pass
            self._refreshed.set()


    def _trim_versions(self, samples: list[tuple[Sample, bytes]], ids: list) -> None:
        for (s, _), entry_id in zip(samples, ids):
            self._version_first_id.setdefault(s.policy_version, entry_id)
        versions = sorted(self._version_first_id)
        if len(versions) <= self.samples_keep_versions:
            return
        keep_from = versions[-self.samples_keep_versions]
        minid = self._version_first_id[keep_from]
        try:
            self.r.xtrim(state.key(self.cluster, "samples"), minid=minid, approximate=False)
        except Exception as e:  # trimming is housekeeping: the next write tries again
            log.debug("sample stream not trimmed: %s", e)
            return
        for v in versions:
            if v < keep_from:
                del self._version_first_id[v]


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(value)"
    return f"{loc}: {err['msg']} (got {_short(err.get('input'))})"


def _short(v: Any, limit: int = 120) -> str:
    """repr cut to `limit` characters: an error about a million-id list must not be a megabyte long."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def _check_name(what: str, v: Any) -> None:
    """Cluster and node names go into Redis keys and '{node}:{gpu}' ids: state.NAME_PATTERN only."""
    if not isinstance(v, str):
        raise TypeError(f"{what} must be a str, got {type(v).__name__}")
    if not _NAME.match(v):
        raise ValueError(f"{what} must match {state.NAME_PATTERN} (letters, digits, _ . -), got {_short(v)}")


def _check_text(what: str, v: Any) -> None:
    """A free-form name (worker, policy path, group id): non-empty, printable, UTF-8, at most MAX_TEXT."""
    if not isinstance(v, str):
        raise TypeError(f"{what} must be a str, got {type(v).__name__}")
    if not v.strip() or len(v) > MAX_TEXT or not v.isprintable():
        raise ValueError(f"{what} must be 1 to {MAX_TEXT} printable characters, got {_short(v)}")
    _check_utf8(what, v)


def _check_utf8(what: str, v: str) -> None:
    try:
        v.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode text (lone surrogate), got {_short(v)}") from None


def _check_count(what: str, v: Any, minimum: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {v}")


def _check_finite(what: str, v: Any) -> None:
    """NaN and infinity are not JSON: pydantic would write them as null, which the reader then refuses."""
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v}")


def _check_seconds(what: str, v: Any, positive: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {type(v).__name__}")
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{what} must be a finite number of seconds {'> 0' if positive else '>= 0'}, got {v}")


def _encodes(call: str, payload: Any) -> bytes:
    """The JSON the writer thread will send; a payload that does not encode is refused here, not there."""
    try:
        return state.encode(payload)
    except PydanticSerializationError as e:  # text that is not UTF-8
        raise ValueError(f"{call}: payload does not encode as JSON: {e}") from None


def _checked_sample(i: int, s: Any) -> tuple[Sample, bytes]:
    """Validate (again, for a Sample built or changed without validation) and encode sample `i`."""
    where = f"submit_samples: samples[{i}]"
    if isinstance(s, Sample):
        s = s.model_dump()
    if not isinstance(s, Mapping):
        raise TypeError(f"{where} must be a Sample or dict, got {type(s).__name__}")
    try:
        sample = Sample.model_validate(s)
    except ValidationError as e:
        raise ValueError(f"{where}.{_first_error(e)}") from None
    for name in ("reward", "ts"):
        _check_finite(f"{where}.{name}", getattr(sample, name))
    n = len(sample.prompt_ids) + len(sample.response_ids)
    if n > MAX_SAMPLE_IDS:
        raise ValueError(f"{where}: prompt_ids + response_ids hold {n} ids, more than {MAX_SAMPLE_IDS}")
    if sample.group_id is not None:
        if len(sample.group_id) > MAX_TEXT:
            raise ValueError(f"{where}.group_id: longer than {MAX_TEXT} characters ({len(sample.group_id)})")
        _check_utf8(f"{where}.group_id", sample.group_id)
    return sample, _encodes(where, sample)


_default: TailspecClient | None = None
_default_lock = threading.Lock()


def connect(
    redis_url: str | None = None, cluster: str | None = None, node: str | None = None, **kw: Any
) -> TailspecClient:
    """Create (or replace) the process-wide client; missing arguments come from the tailspec config
    (TAILSPEC_CONFIG / TAILSPEC_* environment)."""
    global _default
    if redis_url is None or cluster is None or node is None:
        from tailspec.core.config import load_config

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
