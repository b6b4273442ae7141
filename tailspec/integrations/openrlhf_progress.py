"""Per-engine rollout progress for OpenRLHF's vLLM engine actors (no OpenRLHF import: it reads the engines
through the calls OpenRLHF's own generator makes on them).

OpenRLHF 0.11.2's `SamplesGenerator` hands each prompt to one engine actor
(`engine.generate_responses.remote(..., num_samples=n)`, n samples of one prompt) and balances by each
engine's `get_num_unfinished_requests()`. tailspec counts the same two things per engine:

- **started / finished samples**: the generator is given `CountedEngine` wrappers of the engine handles,
  which record each `generate_responses` call (engine, samples, object ref) and pass every other attribute
  through unchanged; a sample is finished when its call's ref is ready (`ray.wait`);
- **in flight**: the engine's own count of unfinished vLLM requests (`get_num_unfinished_requests`).

A thread reports them every `interval_s` while the rollout runs (`report_progress`, worker `<prefix>-<n>`, on
the node and GPUs the engine actor runs on), and once more at the end, with `mem_released=True` when OpenRLHF
put the engines to sleep after the batch (`--vllm.enable_sleep`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from tailspec.scheduler.attach import node_name

log = logging.getLogger(__name__)

Where = tuple[str, list[int]]  # (tailspec node name, GPU indices)


@dataclass
class EngineCount:
    """One engine's counts in the current rollout."""

    started: int = 0
    finished: int = 0
    inflight: int = 0
    pending: list[tuple[Any, int]] = field(default_factory=list)  # (object ref, samples) not yet ready


class _CountedCall:
    def __init__(self, engine: CountedEngine):
        self.engine = engine

    def remote(self, *args: Any, **kw: Any) -> Any:
        e = self.engine
        ref = e.handle.generate_responses.remote(*args, **kw)
        e.progress.dispatched(e.index, int(kw.get("num_samples", 1)), ref)
        return ref


class CountedEngine:
    """An engine actor handle whose `generate_responses.remote` calls are counted; every other attribute is
    the handle's own (OpenRLHF's `batch_vllm_engine_call` and load balancing go straight through)."""

    def __init__(self, handle: Any, index: int, progress: EngineProgress):
        self.handle, self.index, self.progress = handle, index, progress

    @property
    def generate_responses(self) -> _CountedCall:
        return _CountedCall(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)


class EngineProgress:
    """Counts and reports of every engine for one rollout at a time (module doc)."""

    def __init__(self, client: Any, engines: list[Any], where: list[Where], prefix: str, interval_s: float,
                 call_timeout_s: float = 10.0):
        self.client, self.engines, self.where = client, list(engines), list(where)
        self.workers = [f"{prefix}-{i}" for i in range(len(self.engines))]
        self.interval_s, self.call_timeout_s = interval_s, call_timeout_s
        self.counts = [EngineCount() for _ in self.engines]
        self.step = 0
        self.reports = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def wrap(self) -> list[CountedEngine]:
        return [CountedEngine(h, i, self) for i, h in enumerate(self.engines)]

    def dispatched(self, index: int, samples: int, ref: Any) -> None:
        with self._lock:
            c = self.counts[index]
            c.started += samples
            c.pending.append((ref, samples))

    def begin(self, step: int) -> None:
        """A rollout starts: counts at zero, the reporting thread on."""
        self.end_thread()
        with self._lock:
            self.step, self.counts = int(step), [EngineCount() for _ in self.engines]
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tailspec-openrlhf-progress", daemon=True)
        self._thread.start()

    def end(self, mem_released: bool | None) -> list[dict]:
        """The rollout is over: a last report per engine (nothing in flight) and what each saw."""
        self.end_thread()
        self._finish_ready()
        with self._lock:
            for c in self.counts:
                c.inflight = 0
        self._report(mem_released)
        self.client.flush(2.0)
        return self.loads()

    def end_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self.interval_s + self.call_timeout_s + 5)
            self._thread = None

    def loads(self) -> list[dict]:
        with self._lock:
            return [{"worker": w, "started": c.started, "finished": c.finished, "inflight": c.inflight,
                     "where": where} for w, c, where in zip(self.workers, self.counts, self.where)]

    def poll(self) -> None:
        """One round: samples whose calls are back, each engine's unfinished requests, one report each."""
        self._finish_ready()
        try:
            unfinished = ray.get([h.get_num_unfinished_requests.remote() for h in self.engines],
                                 timeout=self.call_timeout_s)
        except Exception as e:  # noqa: BLE001 - a slow or dead engine must not stop the others' reports
            log.warning("tailspec: engines' unfinished requests not read: %s", e)
            unfinished = None
        with self._lock:
            for c, n in zip(self.counts, unfinished or [None] * len(self.counts)):
                # vLLM's count when read; else what the counts say is still out
                c.inflight = int(n) if n is not None else c.started - c.finished
        self._report(None)

    def _finish_ready(self) -> None:
        with self._lock:
            pending = [(i, ref, n) for i, c in enumerate(self.counts) for ref, n in c.pending]
        if not pending:
            return
        ready, _ = ray.wait([ref for _, ref, _ in pending], num_returns=len(pending), timeout=0)
        done = set(ready)
        with self._lock:
            for i, ref, n in pending:
                if ref in done:
                    self.counts[i].finished += n
                    self.counts[i].pending = [(r, m) for r, m in self.counts[i].pending if r is not ref]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def _report(self, mem_released: bool | None) -> None:
        with self._lock:
            rows = [(w, c.inflight, c.finished, c.started, where)
                    for w, c, where in zip(self.workers, self.counts, self.where)]
        for worker, inflight, finished, started, (node, gpus) in rows:
            try:  # best effort: a report must never fail a rollout
                self.client.report_progress(worker, gpus, active=inflight, finished=finished, phase="rollout",
                                            node=node, total=max(started, inflight + finished), step=self.step,
                                            mem_released=mem_released)
            except (ValueError, TypeError) as e:
                log.warning("tailspec: progress of %s not reported: %s", worker, e)
        self.reports += 1


def workers_where(workers: list[dict], fallback_node: str) -> Where:
    """An engine's (node, GPUs) from its workers' `tailspec_where` answers: the first worker's node and every
    GPU its workers use there (an engine spread over nodes is reported on its first node, as verl's replicas
    are); (fallback_node, []) when no worker names a GPU."""
    placed = [(w.get("node_id"), w.get("gpu")) for w in workers if w.get("gpu") is not None]
    if not placed:
        return fallback_node, []
    first = placed[0][0]
    node = node_name(first) if first else fallback_node
    return node, sorted({int(g) for n, g in placed if n == first})


def locate(engines: list[Any], fallback_node: str, call: Callable[[list[Any]], list[Any]] | None = None,
           timeout_s: float = 60.0) -> list[Where]:
    """Each engine actor's (node, GPUs), read by its `tailspec_where` method; (fallback_node, []) for one that
    cannot say (its progress then names no GPU, so it is never lent)."""
    out: list[Where] = []
    for h in engines:
        try:
            node, gpus = (call or (lambda refs: ray.get(refs, timeout=timeout_s)))([h.tailspec_where.remote()])[0]
            out.append((str(node), [int(g) for g in gpus]))
        except Exception as e:  # noqa: BLE001 - an unplaced engine is reported on no GPU, never lent
            log.warning("tailspec: could not locate an OpenRLHF engine (%s); its progress names no GPU", e)
            out.append((fallback_node, []))
    return out
