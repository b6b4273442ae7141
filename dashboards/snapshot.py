"""Read the cluster state through the schema (tailspec.state) into the dashboards' views.

The exporter and the web API both read through here, so `/metrics` and `/api/state` never disagree.
Reads are plain GET / MGET / XRANGE: the dashboards never write to the cluster state. A malformed
entry is counted in `bad_payloads` and skipped, so one bad writer never blanks the dashboard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tailspec import state as S
from tailspec.state import (
    DrafterVersion,
    Event,
    GpuState,
    GpuStatus,
    GpuTelemetry,
    PhaseInfo,
    RolloutStats,
    SessionInfo,
    StateError,
)

from .api import Counters, GpuLane, GpuView, RolloutPoint, Segment, StateView, TelemetrySeries, TimelineView

COUNTER_FIELDS = ("idle_gpu_seconds", "lent_gpu_seconds", "sessions_started", "sessions_stopped",
                  "sessions_preempted")
MAX_WINDOW_S = 86_400.0


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
        ids: set[tuple[str, int]] = set()
        for member in self.r.smembers(self.key("gpus")):
            node, _, gpu = member.decode().rpartition(":")
            if node and gpu.isdigit():
                ids.add((node, int(gpu)))
        prefix = self.key("gpu_status", node="", gpu="")[:-1]  # "tailspec:{c}:gpu_status:"
        for k in self.r.scan_iter(match=prefix + "*", count=500):
            node, _, gpu = k.decode()[len(prefix):].rpartition(":")
            if node and gpu.isdigit():
                ids.add((node, int(gpu)))
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
                state_since=st.since if st else None,
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
            sessions_preempted=int(vals["sessions_preempted"]),
        )

    def sessions(self) -> list[SessionInfo]:
        """Every session record, most recently started first."""
        ids = sorted(m.decode() for m in self.r.smembers(self.key("sessions")))
        if not ids:
            return []
        keys = [self.key("session", session_id=i) for i in ids]
        out = [s for k, raw in zip(keys, self.r.mget(keys)) if (s := self._decode(SessionInfo, raw, k))]
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
               all_sessions: list[SessionInfo] | None = None) -> tuple[StateView, list[SessionInfo]]:
    """One consistent-enough snapshot (separate reads, no transaction: the page refreshes every second).
    Returns the view and the full session list (the exporter's stop-latency histogram needs them all)."""
    rd = Reader(r, cluster)
    now = time.time()
    gpus = rd.gpus()
    sessions = rd.sessions() if all_sessions is None else all_sessions
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


def read_timeline(r: Any, cluster: str, window_s: float = 300.0, max_points: int = 600) -> TimelineView:
    """Per-GPU state segments over the last `window_s` seconds (from the status history stream, state
    at the window start taken from the last transition before it), and utilization / memory series."""
    if not (1.0 <= window_s <= MAX_WINDOW_S):
        raise ValueError(f"window must be in [1, {MAX_WINDOW_S:.0f}] seconds, got {window_s}")
    rd = Reader(r, cluster)
    now = time.time()
    start = now - window_s
    gpus = rd.gpus()
    # Transitions from one window earlier, so the state at `start` is known for GPUs that changed
    # state in it; a GPU whose last transition is older still is in its current state since `since`.
    transitions: dict[tuple[str, int], list[GpuStatus]] = {}
    for _, st in rd._stream("status_history", GpuStatus, start_ms=int((start - window_s) * 1000)):
        transitions.setdefault((st.node, st.gpu), []).append(st)
    lanes = []
    for g in gpus:
        trs = sorted(transitions.get((g.node, g.gpu), []), key=lambda s: s.since)
        # The current status is the newest transition (the scheduler may write it before the stream).
        if g.state_since is not None and (not trs or trs[-1].since < g.state_since):
            trs.append(GpuStatus(node=g.node, gpu=g.gpu, state=g.state, since=g.state_since))
        # Before a GPU's first known transition there is no record: no segment (not "unknown",
        # which is a state the scheduler reports, e.g. for a GPU whose NVML reads fail).
        segs: list[Segment] = []
        prev_state: GpuState | None = None
        prev_t = start
        for st in trs:
            t = min(max(st.since, start), now)
            if prev_state is not None:
                segs.append(Segment(state=prev_state, start=prev_t, end=t))
            prev_state, prev_t = st.state, t
        if prev_state is not None:
            segs.append(Segment(state=prev_state, start=prev_t, end=now, open=True))
        lanes.append(GpuLane(id=g.id, node=g.node, gpu=g.gpu, segments=_merge_segments(segs)))

    series: dict[tuple[str, int], TelemetrySeries] = {}
    for _, t in rd._stream("telemetry_history", GpuTelemetry, start_ms=int(start * 1000)):
        if t.ts < start:
            continue
        s = series.get((t.node, t.gpu))
        if s is None:
            s = series[(t.node, t.gpu)] = TelemetrySeries(
                id=f"{t.node}:{t.gpu}", node=t.node, gpu=t.gpu, simulated=t.simulated, ts=[], util=[], mem_used=[])
        s.ts.append(t.ts)
        s.util.append(t.util)
        s.mem_used.append(t.mem_used)
        s.simulated = s.simulated or t.simulated
    for s in series.values():
        if len(s.ts) > max_points:  # keep every n-th point and the newest
            n = -(-len(s.ts) // max_points)
            idx = list(range(len(s.ts) - 1, -1, -n))[::-1]
            s.ts, s.util, s.mem_used = [s.ts[i] for i in idx], [s.util[i] for i in idx], [s.mem_used[i] for i in idx]
    return TimelineView(
        cluster=cluster, now=now, start=start, window_s=window_s, gpus=lanes,
        telemetry=[series[k] for k in sorted(series)], bad_payloads=rd.bad,
    )
