"""Read the cluster state through the schema (tailspec.core.state) into the dashboards' views.

The exporter and the web API both read through here, so `/metrics` and `/api/state` never disagree.
Reads are plain GET / MGET / XRANGE: the dashboards never write to the cluster state. A malformed
entry is counted in `bad_payloads` and skipped, so one bad writer never blanks the dashboard.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tailspec.core import state as S
from tailspec.core.state import (
    DrafterHealth,
    DrafterVersion,
    Event,
    GpuState,
    GpuStatus,
    GpuTelemetry,
    GuardStatus,
    LineageHead,
    PhaseInfo,
    RolloutStats,
    Sample,
    SchedulerLeader,
    SessionInfo,
    StateError,
)

from .api import (
    Counters,
    GpuLane,
    GpuView,
    RolloutPoint,
    SampleStreamView,
    Segment,
    StateView,
    TelemetrySeries,
    TimelineView,
)

COUNTER_FIELDS = ("idle_gpu_seconds", "lent_gpu_seconds", "sessions_started", "sessions_stopped",
                  "sessions_preempted", "sessions_declined", "drafter_guard_trips")
MAX_WINDOW_S = 86_400.0


class SessionCache:
    """The records of ended sessions (stopped or failed), kept by a long-lived reader (the web server, the exporter)
    across its reads. The cluster's `sessions` set names every session of the run and a refresh reads every record,
    so without it a refresh costs in proportion to the run's age; a stopped or failed record is final (the scheduler
    writes a final record only for a session that has none, scheduler/lessor.py), so it is read and decoded once. A
    session set that shrank (the state cleared) empties the cache: its ids may come again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended: dict[str, SessionInfo] = {}
        self._size = 0  # the session set's size at the last read

    def ended(self, size: int) -> dict[str, SessionInfo]:
        """The ended sessions' records (a copy), given the session set's size now."""
        with self._lock:
            if size < self._size:
                self._ended.clear()
            self._size = size
            return dict(self._ended)

    def keep(self, records: dict[str, SessionInfo]) -> None:
        """Records just read, by the id the session set names them by: those of ended sessions are kept."""
        with self._lock:
            self._ended.update((i, s) for i, s in records.items() if s.status in ("stopped", "failed"))


@dataclass
class Reader:
    """Reads one cluster's state; `bad` counts malformed entries seen during the last read."""

    r: Any  # redis.Redis
    cluster: str
    bad: int = 0
    errors: list[str] = field(default_factory=list)

    def key(self, name: str, **fields: Any) -> str:
        return S.key(self.cluster, name, **fields)

    def _decode(self, model, raw, where: str):
        if raw is None:
            return None
        try:
            return S.decode(model, raw, where=where)
        except StateError as e:
            self.bad += 1
            if len(self.errors) < 20:
                self.errors.append(str(e))
            return None

    def _stream(self, name: str, model, start_ms: int | None = None, count: int | None = None,
                newest: bool = False) -> list[tuple[float, Any]]:
        """[(entry time in s, payload)], oldest first. newest=True reads the last `count` entries."""
        k = self.key(name)
        if newest:
            entries = list(reversed(self.r.xrevrange(k, max="+", min="-", count=count)))
        else:
            entries = self.r.xrange(k, min=f"{start_ms}-0" if start_ms is not None else "-", max="+", count=count)
        out = []
        for entry_id, fields in entries:
            p = self._decode(model, fields.get(b"data"), where=f"{k} {entry_id!r}")
            if p is not None:
                out.append((int(entry_id.split(b"-")[0]) / 1000.0, p))
        return out

    # ---- GPUs ----------------------------------------------------------------------------------

    def gpu_ids(self) -> list[tuple[str, int]]:
        """Every GPU the telemetry monitor registered or the scheduler tracks, sorted by node then index."""
        prefix = self.key("gpu_status", node="", gpu="")[:-1]  # "tailspec:{c}:gpu_status:"
        found = [*self.r.smembers(self.key("gpus")),
                 *(k.decode()[len(prefix):] for k in self.r.scan_iter(match=prefix + "*", count=500))]
        ids: set[tuple[str, int]] = {k for k in map(S.gpu_of, found) if k is not None}
        return sorted(ids)

    def gpus(self) -> list[GpuView]:
        ids = self.gpu_ids()
        if not ids:
            return []
        tkeys = [self.key("telemetry", node=n, gpu=g) for n, g in ids]
        skeys = [self.key("gpu_status", node=n, gpu=g) for n, g in ids]
        raw = self.r.mget(tkeys + skeys)
        out = []
        for i, (node, gpu) in enumerate(ids):
            tel: GpuTelemetry | None = self._decode(GpuTelemetry, raw[i], tkeys[i])
            st: GpuStatus | None = self._decode(GpuStatus, raw[len(ids) + i], skeys[i])
            out.append(GpuView(
                id=f"{node}:{gpu}", node=node, gpu=gpu,
                state=st.state if st else GpuState.UNKNOWN,
                state_since=st.since if st and st.since > 0 else None,  # 0 = never set
                worker=st.worker if st else None,
                session_id=st.session_id if st else None,
                lease_token=st.lease_token if st else None,
                util=tel.util if tel else None,
                mem_used=tel.mem_used if tel else None,
                mem_total=tel.mem_total if tel else None,
                power_w=tel.power_w if tel else None,
                simulated=tel.simulated if tel else None,
                telemetry_ts=tel.ts if tel else None,
                error=tel.error if tel else None,
                device=tel.device if tel else None,
                device_util=tel.device_util if tel else None,
                device_mem_used=tel.device_mem_used if tel else None,
            ))
        return out

    # ---- the rest of the snapshot --------------------------------------------------------------

    def counters(self) -> Counters:
        raw = self.r.hgetall(self.key("counters"))
        vals: dict[str, float] = {}
        for f in COUNTER_FIELDS:
            v = raw.get(f.encode())
            try:
                vals[f] = float(v) if v is not None else 0.0
            except ValueError:
                self.bad += 1
                vals[f] = 0.0
        idle, lent = vals["idle_gpu_seconds"], vals["lent_gpu_seconds"]
        return Counters(
            idle_gpu_seconds=idle, lent_gpu_seconds=lent, reclaimed_share=reclaimed_share(idle, lent),
            sessions_started=int(vals["sessions_started"]), sessions_stopped=int(vals["sessions_stopped"]),
            sessions_preempted=int(vals["sessions_preempted"]), sessions_declined=int(vals["sessions_declined"]),
            drafter_guard_trips=int(vals["drafter_guard_trips"]),
        )

    def sessions(self, cache: SessionCache | None = None) -> list[SessionInfo]:
        """Every session record, most recently started first. With `cache`, the records of sessions it holds as
        ended are not read again (SessionCache)."""
        ids = sorted(m.decode() for m in self.r.smembers(self.key("sessions")))
        if not ids:
            return []
        ended = cache.ended(len(ids)) if cache is not None else {}
        todo = [i for i in ids if i not in ended]
        keys = [self.key("session", session_id=i) for i in todo]
        read = {i: s for i, k, raw in zip(todo, keys, self.r.mget(keys) if keys else [])
                if (s := self._decode(SessionInfo, raw, k))}
        if cache is not None:
            cache.keep(read)
        out = [*read.values(), *(ended[i] for i in ids if i in ended)]
        return sorted(out, key=lambda s: s.started_at, reverse=True)

    def drafter(self, limit: int = 200) -> tuple[DrafterVersion | None, list[DrafterVersion]]:
        k = self.key("drafter_current")
        current = self._decode(DrafterVersion, self.r.get(k), k)
        lk = self.key("drafter_versions")
        versions = [v for raw in self.r.lrange(lk, -limit, -1) if (v := self._decode(DrafterVersion, raw, lk))]
        return current, versions

    def rollout(self, limit: int = 500) -> list[RolloutPoint]:
        out = []
        for _, s in self._stream("rollout_stats", RolloutStats, count=limit, newest=True):
            tps = s.tokens / s.seconds if s.seconds > 0 else None
            base = s.baseline_tokens_per_s
            out.append(RolloutPoint(
                worker=s.worker, step=s.step, ts=s.ts, acceptance_length=s.acceptance_length,
                tokens_per_s=tps, baseline_tokens_per_s=base,
                speedup=tps / base if tps is not None and base else None,
                strategy_mix=s.strategy_mix, drafter_version=s.drafter_version,
            ))
        return out

    def dropped(self) -> dict[str, int]:
        out = {}
        for reason, v in self.r.hgetall(self.key("dropped")).items():
            try:
                out[reason.decode(errors="replace")] = int(float(v))
            except ValueError:
                self.bad += 1
        return dict(sorted(out.items()))

    def events(self, limit: int = 30) -> list[Event]:
        return [e for _, e in reversed(self._stream("events", Event, count=limit, newest=True))]

    def drafter_guard(self) -> list[GuardStatus]:
        """Every rollout worker's latest health-guard verdict, by worker name."""
        k = self.key("drafter_guard")
        out = [g for _, raw in sorted(self.r.hgetall(k).items()) if (g := self._decode(GuardStatus, raw, k))]
        return out

    def lineage(self) -> LineageHead | None:
        k = self.key("lineage_head")
        return self._decode(LineageHead, self.r.get(k), k)

    def drafter_health(self, limit: int = 200) -> list[DrafterHealth]:
        return [h for _, h in self._stream("drafter_health", DrafterHealth, count=limit, newest=True)]

    def samples(self) -> SampleStreamView:
        """Length of the sample stream and the policy versions at its two ends (two entries read)."""
        k = self.key("samples")
        ends = []
        for raw in (self.r.xrange(k, count=1), self.r.xrevrange(k, count=1)):
            s = self._decode(Sample, (raw[0][1].get(b"data") if raw else None), k) if raw else None
            ends.append(s.policy_version if s is not None else None)
        return SampleStreamView(length=int(self.r.xlen(k)), oldest_policy_version=ends[0], newest_policy_version=ends[1])

    def sessions_by_id(self, ids: list[str]) -> dict[str, SessionInfo]:
        """The records of these sessions (one MGET), by id; missing or malformed ones left out."""
        if not ids:
            return {}
        keys = [self.key("session", session_id=i) for i in ids]
        return {i: s for i, k, raw in zip(ids, keys, self.r.mget(keys)) if (s := self._decode(SessionInfo, raw, k))}

    def leader(self) -> SchedulerLeader | None:
        """The leading scheduler's record (others stand by); None when no scheduler leads."""
        k = self.key("leader")
        return self._decode(SchedulerLeader, self.r.get(k), k)

    def phase(self) -> PhaseInfo | None:
        k = self.key("phase")
        return self._decode(PhaseInfo, self.r.get(k), k)

    def heartbeat_age(self, now: float) -> float | None:
        raw = self.r.get(self.key("scheduler_heartbeat"))
        try:
            return max(0.0, now - float(raw)) if raw is not None else None
        except ValueError:
            self.bad += 1
            return None


def reclaimed_share(idle_gpu_seconds: float, lent_gpu_seconds: float) -> float | None:
    """Share of the tail's idle GPU time that went to drafter training (lent is part of idle)."""
    if idle_gpu_seconds <= 0:
        return None
    return min(1.0, max(0.0, lent_gpu_seconds / idle_gpu_seconds))


def read_state(r: Any, cluster: str, sessions_limit: int | None = 50,
               all_sessions: list[SessionInfo] | None = None, cache: SessionCache | None = None
               ) -> tuple[StateView, list[SessionInfo]]:
    """One consistent-enough snapshot (separate reads, no transaction: the page refreshes every second).
    Returns the view and the full session list (the exporter's stop-latency histogram needs them all). `cache`: a
    long-lived reader's ended sessions, not read again."""
    rd = Reader(r, cluster)
    now = time.time()
    gpus = rd.gpus()
    sessions = rd.sessions(cache) if all_sessions is None else all_sessions
    current, versions = rd.drafter()
    view = StateView(
        cluster=cluster, now=now,
        simulated=any(g.simulated for g in gpus),
        phase=rd.phase(),
        scheduler_heartbeat_age_s=rd.heartbeat_age(now),
        gpus=gpus,
        counters=rd.counters(),
        sessions=sessions[:sessions_limit] if sessions_limit is not None else sessions,
        sessions_total=len(sessions),
        drafter_current=current,
        drafter_versions=versions,
        rollout=rd.rollout(),
        dropped=rd.dropped(),
        events=rd.events(),
        lineage=rd.lineage(),
        drafter_health=rd.drafter_health(),
        drafter_guard=rd.drafter_guard(),
        samples=rd.samples(),
        bad_payloads=rd.bad,
    )
    return view, sessions


def _merge_segments(segs: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segs:
        if s.end <= s.start:
            continue
        if out and out[-1].state == s.state and abs(out[-1].end - s.start) < 1e-9:
            out[-1] = Segment(state=s.state, start=out[-1].start, end=s.end, open=s.open)
        else:
            out.append(s)
    return out


StatusRow = tuple[float, str, int, GpuState]  # since, node, gpu, state
TelemetryRow = tuple[float, str, int, float, int, bool]  # ts, node, gpu, util, mem_used, simulated


def _status_row(s: GpuStatus, entry_s: float) -> StatusRow:
    # A transition without a time (since=0) is dated by its stream entry (when it was published).
    return (s.since if s.since > 0 else entry_s, s.node, s.gpu, s.state)


def _telemetry_row(t: GpuTelemetry, entry_s: float) -> TelemetryRow:
    return (t.ts, t.node, t.gpu, t.util, t.mem_used, t.simulated)


class StreamCache:
    """One history stream, decoded once and kept in the server's memory as small rows, read
    incrementally: a poll fetches only the entries added since the last one (XRANGE after the last id
    seen), so the page's polling costs O(new entries) instead of O(window). Entries are kept for at
    most MAX_WINDOW_S and `max_rows`; a stream that was recreated (ids went back) is re-read."""

    def __init__(self, name: str, model: type, project: Any, max_rows: int = 200_000):
        self.name, self.model, self.project, self.max_rows = name, model, project, max_rows
        self.rows: list[tuple[int, tuple]] = []  # (entry ms, row), in stream order
        self.last_id: bytes | None = None
        self.from_ms: int | None = None  # every entry at or after this time is held
        self.lock = threading.Lock()

    def _decode_into(self, rd: Reader, key: str, entries: list) -> list[tuple[int, tuple]]:
        out = []
        for entry_id, fields in entries:
            p = rd._decode(self.model, fields.get(b"data"), where=f"{key} {entry_id!r}")
            if p is not None:
                ms = int(entry_id.split(b"-")[0])
                out.append((ms, self.project(p, ms / 1000.0)))
        return out

    def read(self, rd: Reader, start_ms: int) -> list[tuple]:
        """Rows of entries added at or after `start_ms` (entry time), oldest first."""
        key = rd.key(self.name)
        with self.lock:
            newest = rd.r.xrevrange(key, max="+", min="-", count=1)
            if not newest:
                self.rows, self.last_id, self.from_ms = [], None, None
                return []
            if self.last_id is not None and _id_key(newest[0][0]) < _id_key(self.last_id):
                self.rows, self.last_id, self.from_ms = [], None, None  # stream recreated
            if self.from_ms is None or self.last_id is None:
                entries = rd.r.xrange(key, min=f"{start_ms}-0", max="+")
                self.rows = self._decode_into(rd, key, entries)
                self.from_ms = start_ms
                self.last_id = newest[0][0]
            else:
                if start_ms < self.from_ms:  # a longer window than held so far: fetch the older part
                    older = rd.r.xrange(key, min=f"{start_ms}-0", max=f"({self.from_ms}-0")
                    self.rows = self._decode_into(rd, key, older) + self.rows
                    self.from_ms = start_ms
                entries = rd.r.xrange(key, min=b"(" + self.last_id, max="+")
                self.rows.extend(self._decode_into(rd, key, entries))
            if entries:  # entries added after the XREVRANGE above were read too: resume after them
                self.last_id = max(self.last_id, entries[-1][0], key=_id_key)
            oldest_ms = int((time.time() - MAX_WINDOW_S) * 1000)
            if len(self.rows) > self.max_rows or (self.rows and self.rows[0][0] < oldest_ms):
                keep = bisect.bisect_left(self.rows, (oldest_ms,))
                keep = max(keep, len(self.rows) - self.max_rows)
                self.rows = self.rows[keep:]
                self.from_ms = max(self.from_ms, self.rows[0][0] if self.rows else oldest_ms)
            i = bisect.bisect_left(self.rows, (start_ms,))
            return [row for _, row in self.rows[i:]]


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


@dataclass
class HistoryCache:
    """The web server's incremental copies of the status and telemetry histories (one per App)."""

    status: StreamCache = field(default_factory=lambda: StreamCache("status_history", GpuStatus, _status_row))
    telemetry: StreamCache = field(
        default_factory=lambda: StreamCache("telemetry_history", GpuTelemetry, _telemetry_row))


def read_timeline(r: Any, cluster: str, window_s: float = 300.0, max_points: int = 300,
                  cache: HistoryCache | None = None) -> TimelineView:
    """Per-GPU state segments over the last `window_s` seconds (from the status history stream, state
    at the window start taken from the last transition before it), and utilization / memory series
    (at most `max_points` per GPU). With `cache`, the histories are read incrementally."""
    if not (1.0 <= window_s <= MAX_WINDOW_S):
        raise ValueError(f"window must be in [1, {MAX_WINDOW_S:.0f}] seconds, got {window_s}")
    rd = Reader(r, cluster)
    now = time.time()
    start = now - window_s
    gpus = rd.gpus()
    # Transitions from one window earlier, so the state at `start` is known for GPUs that changed
    # state in it; a GPU whose last transition is older still is in its current state since `since`.
    lookback_ms = int((start - window_s) * 1000)
    if cache is not None:
        status_rows: list[StatusRow] = cache.status.read(rd, lookback_ms)
    else:
        status_rows = [_status_row(p, t) for t, p in rd._stream("status_history", GpuStatus, start_ms=lookback_ms)]
    lanes = _lanes(gpus, status_rows, start, now)
    start_ms = int(start * 1000)
    if cache is not None:
        tel_rows: list[TelemetryRow] = cache.telemetry.read(rd, start_ms)
    else:
        tel_rows = [_telemetry_row(p, t) for t, p in rd._stream("telemetry_history", GpuTelemetry,
                                                                start_ms=start_ms)]
    return TimelineView(cluster=cluster, now=now, start=start, window_s=window_s, gpus=lanes,
                        telemetry=_series(tel_rows, start, max_points), bad_payloads=rd.bad)


def _lanes(gpus: list, status_rows: list[StatusRow], start: float, now: float) -> list[GpuLane]:
    """Each GPU's state segments in [start, now] from its transitions."""
    transitions: dict[tuple[str, int], list[StatusRow]] = {}
    for row in status_rows:
        transitions.setdefault((row[1], row[2]), []).append(row)
    lanes = []
    for g in gpus:
        trs = sorted(transitions.get((g.node, g.gpu), []), key=lambda row: row[0])
        # The current status is the newest transition (the scheduler may write it before the stream).
        if g.state_since is not None and (not trs or trs[-1][0] < g.state_since):
            trs.append((g.state_since, g.node, g.gpu, g.state))
        # Before a GPU's first known transition there is no record: no segment (not "unknown",
        # which is a state the scheduler reports, e.g. for a GPU whose NVML reads fail).
        segs: list[Segment] = []
        prev_state: GpuState | None = None
        prev_t = start
        for since, _, _, st in trs:
            t = min(max(since, start), now)
            if prev_state is not None:
                segs.append(Segment(state=prev_state, start=prev_t, end=t))
            prev_state, prev_t = st, t
        if prev_state is not None:
            segs.append(Segment(state=prev_state, start=prev_t, end=now, open=True))
        lanes.append(GpuLane(id=g.id, node=g.node, gpu=g.gpu, segments=_merge_segments(segs)))
    return lanes


def _series(tel_rows: list[TelemetryRow], start: float, max_points: int) -> list[TelemetrySeries]:
    """Utilization and memory series per GPU since `start`, at most `max_points` each."""
    cols: dict[tuple[str, int], tuple[list[float], list[float], list[int], list[bool]]] = {}
    for ts, node, gpu, util, mem, sim in tel_rows:
        if ts < start:
            continue
        c = cols.setdefault((node, gpu), ([], [], [], []))
        c[0].append(ts)
        c[1].append(util)
        c[2].append(mem)
        c[3].append(sim)
    telemetry = []
    for (node, gpu), (ts, util, mem, sim) in sorted(cols.items()):
        if len(ts) > max_points:  # keep every n-th point, counted back from the newest
            n = -(-len(ts) // max_points)
            idx = range((len(ts) - 1) % n, len(ts), n)
            ts, util, mem = [ts[i] for i in idx], [util[i] for i in idx], [mem[i] for i in idx]
        telemetry.append(TelemetrySeries(id=f"{node}:{gpu}", node=node, gpu=gpu, simulated=any(sim),
                                         ts=ts, util=util, mem_used=mem))
    return telemetry
