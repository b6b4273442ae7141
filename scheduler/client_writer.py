"""The client's write path: the background thread that takes what the calls buffered and writes it to Redis.

One pipeline per batch: the phase (and its event), each worker's latest progress (re-sent before its key
expires; a report that drains a worker's GPUs is announced on the phase's channel), up to 1,000 samples, the drop counters, and the reads that refresh the cached drafter version and
phase. Redis down or slow: progress and phase are put back (newest wins) and retried with a growing backoff;
the batch's samples are dropped and counted (`redis_unavailable`), so the buffers stay bounded.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from tailspec.core import redis_conn, state
from tailspec.core.state import DrafterVersion, Event, PhaseInfo, Progress, Sample

log = logging.getLogger("tailspec.scheduler.client")

BATCH_SAMPLES = 1000  # samples per pipeline


class ClientWriter:
    """The writer half of `TailspecClient` (scheduler/client.py), which sets these attributes up."""

    r: Any
    cluster: str
    progress_ttl_s: float
    refresh_s: float
    samples_maxlen: int
    samples_keep_versions: int
    errors: int
    dropped: collections.Counter[str]
    sent: collections.Counter[str]
    _redis_url: str
    _lock: threading.Lock
    _wake: threading.Event
    _closed: threading.Event
    _refreshed: threading.Event
    _progress: dict[str, Progress]
    _last_sent: dict[str, tuple[Progress, float]]
    _phase: PhaseInfo | None
    _phase_seen: PhaseInfo | None
    _drafter: DrafterVersion | None
    _writing: bool
    _samples: collections.deque[tuple[Sample, bytes]]
    _dropped_unsynced: collections.Counter[str]
    _version_first_id: dict[int, bytes]
    _last_refresh: float

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
        now = time.time()
        progress, phase, samples, dropped = self._take_batch(now)
        pipe = self.r.pipeline(transaction=False)
        self._queue_phase(pipe, phase)
        self._queue_progress(pipe, progress)
        first_sample = len(pipe.command_stack)
        self._queue_samples(pipe, samples, dropped)
        refresh = now - self._last_refresh >= self.refresh_s or not self._refreshed.is_set()
        if refresh:
            pipe.get(state.key(self.cluster, "drafter_current"))
            pipe.get(state.key(self.cluster, "phase"))
        try:
            res = pipe.execute()
        except Exception:
            self._put_back(progress, phase, samples, dropped)
            raise
        for w, p in progress.items():
            self._last_sent[w] = (p, now)
        self.sent["progress"] += len(progress)
        self.sent["samples"] += len(samples)
        if samples:
            self._trim_versions(samples, res[first_sample : first_sample + len(samples)])
        if refresh:
            self._last_refresh = now
            self._refresh(res[-2], res[-1])

    def _take_batch(
        self, now: float
    ) -> tuple[dict[str, Progress], PhaseInfo | None, list[tuple[Sample, bytes]], collections.Counter[str]]:
        """Empty the buffers into one batch (marked in flight for flush); progress gets keep-alive re-sends of
        each worker's last report before its key expires."""
        with self._lock:
            progress, self._progress = self._progress, {}
            phase, self._phase = self._phase, None
            n = min(len(self._samples), BATCH_SAMPLES)
            samples = [self._samples.popleft() for _ in range(n)]
            dropped, self._dropped_unsynced = self._dropped_unsynced, collections.Counter()
            self._writing = True
        for w, (p, sent_at) in self._last_sent.items():
            if w not in progress and now - sent_at > self.progress_ttl_s / 3:
                progress[w] = p
        return progress, phase, samples, dropped

    def _queue_phase(self, pipe: Any, phase: PhaseInfo | None) -> None:
        if phase is None:
            return
        c = self.cluster
        pipe.set(state.key(c, "phase"), state.encode(phase))
        # The scheduler waits for its next tick on this channel (scheduler/phase_wake.py): a phase change, the
        # trainer's update above all, is acted on at once instead of up to a tick later.
        pipe.publish(state.key(c, "phase"), phase.phase)
        event = Event(kind="phase", detail={"phase": phase.phase, "step": phase.step,
                                            "policy_version": phase.policy_version})
        pipe.xadd(state.key(c, "events"), {"data": state.encode(event)}, maxlen=20_000, approximate=True)

    def _queue_progress(self, pipe: Any, progress: dict[str, Progress]) -> None:
        px = int(self.progress_ttl_s * 1000)
        drained = False
        for w, p in progress.items():
            pipe.set(state.key(self.cluster, "progress", worker=w), state.encode(p), px=px)
            pipe.sadd(state.key(self.cluster, "workers"), w)
            last = self._last_sent.get(w)
            drained |= newly_drained(None if last is None else last[0], p)
        if drained:  # after the progress it announces, on the phase's channel: the scheduler and a simulated GPU's
            # monitor wait on it (scheduler/phase_wake.py), so a drained GPU is sampled and lent at once
            pipe.publish(state.key(self.cluster, "phase"), "drained")

    def _queue_samples(self, pipe: Any, samples: list[tuple[Sample, bytes]], dropped: collections.Counter[str]) -> None:
        c = self.cluster
        for _, data in samples:
            pipe.xadd(state.key(c, "samples"), {"data": data}, maxlen=self.samples_maxlen, approximate=True)
        for reason, k in dropped.items():
            pipe.hincrby(state.key(c, "dropped"), reason, k)

    def _put_back(
        self,
        progress: dict[str, Progress],
        phase: PhaseInfo | None,
        samples: list[tuple[Sample, bytes]],
        dropped: collections.Counter[str],
    ) -> None:
        """A batch Redis refused: progress and phase go back (newest wins, so only what was not replaced since),
        drop counts are kept for the next batch, samples are dropped and counted."""
        with self._lock:
            for w, p in progress.items():
                self._progress.setdefault(w, p)
            if phase is not None and self._phase is None:
                self._phase = phase
            for reason, k in dropped.items():
                self._dropped_unsynced[reason] += k
        if samples:
            self._drop("redis_unavailable", len(samples))

    def _refresh(self, raw_drafter: Any, raw_phase: Any) -> None:
        """The cached drafter version and phase that current_drafter / current_phase return."""
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


def newly_drained(last: Progress | None, p: Progress) -> bool:
    """Whether report `p` drains its worker's GPUs where the last report sent (`last`) did not: no active request
    in a rollout step, first seen (or newly with its memory released, which lends without the idle window). A
    keep-alive re-send of the same report is not a drain."""
    if p.phase != "rollout" or p.active > 0:
        return False
    return (last is None or last.phase != "rollout" or last.active > 0 or last.step != p.step
            or last.mem_released != p.mem_released)
