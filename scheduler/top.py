"""`tailspec top`: a live terminal table of every GPU (like nvtop / gpustat), read from the cluster state.

One row per GPU: state, utilization, memory, power, the worker that owns it, the lease holder (token,
session) and the session's step and loss. Simulated telemetry is marked "sim" in the row and
"SIMULATED telemetry" in the title.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tailspec.core import state
from tailspec.core.state import (
    GpuStatus,
    GpuTelemetry,
    Lease,
    PhaseInfo,
    SchedulerLeader,
    SessionInfo,
    StateError,
)


@dataclass
class Row:
    node: str
    gpu: int
    state: str
    util: float | None
    mem_used: int | None
    mem_total: int | None
    power_w: float | None
    simulated: bool
    error: str | None
    worker: str | None
    lease_token: int | None
    session_id: str | None
    session_status: str | None
    session_step: int | None
    session_loss: float | None


@dataclass
class Snapshot:
    phase: PhaseInfo | None
    rows: list[Row]
    counters: dict[str, float]
    heartbeat_age_s: float | None
    last_decline: str | None = None  # "node0:gpu1 session … declined: needs …" (the memory handshake)
    leader: SchedulerLeader | None = None  # the leading scheduler (others stand by)

    @property
    def simulated(self) -> bool:
        return any(r.simulated for r in self.rows)


def _safe(model: Any, raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return state.decode(model, raw)
    except StateError:
        return None


def gather(r: Any, cluster: str) -> Snapshot:
    gpus = []
    for g in r.smembers(state.key(cluster, "gpus")):
        node, _, idx = (g.decode() if isinstance(g, bytes) else g).rpartition(":")
        if idx.isdigit():
            gpus.append((node, int(idx)))
    gpus.sort()
    pipe = r.pipeline(transaction=False)
    pipe.get(state.key(cluster, "phase"))
    pipe.hgetall(state.key(cluster, "counters"))
    pipe.get(state.key(cluster, "scheduler_heartbeat"))
    pipe.get(state.key(cluster, "leader"))
    for node, g in gpus:
        pipe.get(state.key(cluster, "telemetry", node=node, gpu=g))
        pipe.get(state.key(cluster, "gpu_status", node=node, gpu=g))
        pipe.get(state.key(cluster, "lease", node=node, gpu=g))
    raw = pipe.execute()
    phase = _safe(PhaseInfo, raw[0])
    counters = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in (raw[1] or {}).items()}
    hb_age = None
    if raw[2] is not None:
        try:
            hb_age = max(0.0, time.time() - float(raw[2]))
        except ValueError:
            pass
    leader: SchedulerLeader | None = _safe(SchedulerLeader, raw[3])
    partial = []
    sids = []
    for i, (node, g) in enumerate(gpus):
        t: GpuTelemetry | None = _safe(GpuTelemetry, raw[4 + 3 * i])
        st: GpuStatus | None = _safe(GpuStatus, raw[5 + 3 * i])
        lease: Lease | None = _safe(Lease, raw[6 + 3 * i])
        sid = st.session_id if st and st.session_id else None
        partial.append((node, g, t, st, lease, sid))
        sids.append(sid)
    sessions: dict[str, SessionInfo] = {}
    wanted = [s for s in sids if s]
    if wanted:
        vals = r.mget([state.key(cluster, "session", session_id=s) for s in wanted])
        for s, v in zip(wanted, vals):
            info = _safe(SessionInfo, v)
            if info is not None:
                sessions[s] = info
    rows = []
    for node, g, t, st, lease, sid in partial:
        info = sessions.get(sid) if sid else None
        rows.append(
            Row(
                node=node,
                gpu=g,
                state=st.state.value if st else "unknown",
                util=t.util if t else None,
                mem_used=t.mem_used if t else None,
                mem_total=t.mem_total if t else None,
                power_w=t.power_w if t else None,
                simulated=bool(t and t.simulated),
                error=t.error if t else None,
                worker=st.worker if st else None,
                lease_token=lease.token if lease else None,
                session_id=sid,
                session_status=info.status if info else None,
                session_step=info.step if info else None,
                session_loss=info.loss if info else None,
            )
        )
    decline = _last_decline(r, cluster) if counters.get("sessions_declined") else None
    return Snapshot(phase, rows, counters, hb_age, decline, leader)


def _last_decline(r: Any, cluster: str, look_back: int = 500) -> str | None:
    """The newest session_declined event among the last `look_back` events, as one line."""
    for _, fields in r.xrevrange(state.key(cluster, "events"), count=look_back):
        ev = _safe(state.Event, fields.get(b"data") or fields.get("data"))
        if ev is not None and ev.kind == "session_declined":
            return f"{ev.node}:gpu{ev.gpu} {ev.detail.get('session_id')}: {ev.detail.get('reason')}"
    return None


def _gib(b: int | None) -> str:
    return "-" if b is None else f"{b / (1 << 30):.1f}"



def _cells(r, state: str, util: str) -> list[str]:
    """One GPU row's cells, shared by the plain and the rich table (only state/util styling differs)."""
    return [
        f"{r.node}:{r.gpu}",
        state,
        util,
        f"{_gib(r.mem_used)}/{_gib(r.mem_total)}",
        "-" if r.power_w is None else f"{r.power_w:.0f}",
        r.worker or "-",
        "-" if r.lease_token is None else f"t{r.lease_token}",
        r.session_id or "-",
        "-" if r.session_step is None else str(r.session_step),
        "-" if r.session_loss is None else f"{r.session_loss:.4g}",
    ]

def _header(snap: Snapshot, cluster: str) -> list[str]:
    ph = snap.phase
    c = snap.counters
    idle, lent = c.get("idle_gpu_seconds", 0.0), c.get("lent_gpu_seconds", 0.0)
    head = [
        f"tailspec top — cluster {cluster}" + (" — SIMULATED telemetry (no NVML)" if snap.simulated else ""),
        f"phase {ph.phase} step {ph.step} policy v{ph.policy_version}" if ph else "phase: (none reported)",
        f"scheduler heartbeat: {snap.heartbeat_age_s:.1f}s ago"
        if snap.heartbeat_age_s is not None
        else "scheduler: not running",
        f"leader {snap.leader.holder} (epoch {snap.leader.epoch}); other schedulers stand by"
        if snap.leader is not None
        else "leader: none",
        f"idle {idle:.1f} GPU-s, lent {lent:.1f} GPU-s, reclaimed {lent / idle:.0%}"
        if idle > 0
        else f"idle {idle:.1f} GPU-s, lent {lent:.1f} GPU-s",
        f"sessions started {int(c.get('sessions_started', 0))}, stopped {int(c.get('sessions_stopped', 0))}, "
        f"preempted {int(c.get('sessions_preempted', 0))}, declined {int(c.get('sessions_declined', 0))}",
    ]
    if snap.last_decline:
        head.append(f"last declined: {snap.last_decline}")
    return head


def render_text(snap: Snapshot, cluster: str) -> str:
    """Plain-text table (for --once, logs and tests)."""
    head = _header(snap, cluster)
    cols = ["GPU", "STATE", "UTIL%", "MEM GiB", "POWER W", "WORKER", "LEASE", "SESSION", "STEP", "LOSS"]
    body = []
    for r in snap.rows:
        util = "-" if r.util is None else f"{r.util:5.1f}" + (" sim" if r.simulated else "")
        if r.error:
            util = f"ERR {r.error[:30]}"
        body.append(_cells(r, r.state, util))
    widths = [max(len(x) for x in col) for col in zip(cols, *body)] if body else [len(x) for x in cols]
    lines = head + ["", "  ".join(h.ljust(w) for h, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in body]
    if not body:
        lines.append("(no GPU reported yet: is a telemetry monitor running?)")
    return "\n".join(lines)


_STATE_STYLE = {
    "generating": "green",
    "drained": "yellow",
    "lent": "cyan",
    "reclaiming": "magenta",
    "unknown": "dim",
}


def render_rich(snap: Snapshot, cluster: str) -> Any:
    from rich.table import Table

    title = f"tailspec top — {cluster}" + (" — [bold red]SIMULATED telemetry[/]" if snap.simulated else "")
    t = Table(title=title, caption=" | ".join(_header(snap, cluster)[1:]))
    for col in ["GPU", "STATE", "UTIL%", "MEM GiB", "POWER W", "WORKER", "LEASE", "SESSION", "STEP", "LOSS"]:
        t.add_column(col)
    for r in snap.rows:
        util = "-" if r.util is None else f"{r.util:5.1f}" + (" sim" if r.simulated else "")
        if r.error:
            util = f"[red]ERR {r.error[:30]}[/]"
        t.add_row(*_cells(r, f"[{_STATE_STYLE.get(r.state, 'white')}]{r.state}[/]", util))
    return t


def run_top(r: Any, cluster: str, interval_s: float = 0.5, once: bool = False) -> None:
    if once:
        print(render_text(gather(r, cluster), cluster))
        return
    from rich.live import Live

    with Live(
        render_rich(gather(r, cluster), cluster), refresh_per_second=max(1, int(1 / interval_s))
    ) as live:
        while True:
            time.sleep(interval_s)
            try:
                live.update(render_rich(gather(r, cluster), cluster))
            except Exception as e:  # Redis blip: show it, keep going
                live.update(f"tailspec top: cannot read cluster state ({e})")
