"""`tailspec top`: a live terminal table of every GPU (like nvtop / gpustat), read from the cluster state
through the dashboards' reader (dashboards.snapshot.Reader), so the table and the web views agree.

One row per GPU: state, utilization, memory, power, the worker that owns it, the lease holder (token,
session) and the session's step and loss. Simulated telemetry is marked "sim" in the row and
"SIMULATED telemetry" in the title.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.live import Live
from rich.table import Table

from tailspec.core.state import PhaseInfo, SchedulerLeader
from tailspec.dashboards.snapshot import Reader


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


def gather(r: Any, cluster: str) -> Snapshot:
    """One read of the cluster state for the table, through the dashboards' reader (one reader of the
    cluster state for every view: a malformed entry is skipped and counted the same way everywhere)."""
    rd = Reader(r, cluster)
    views = rd.gpus()
    counters = rd.counters().model_dump()
    sessions = rd.sessions_by_id([g.session_id for g in views if g.session_id])
    rows = []
    for g in views:
        info = sessions.get(g.session_id) if g.session_id else None
        rows.append(Row(
            node=g.node, gpu=g.gpu, state=g.state.value, util=g.util, mem_used=g.mem_used, mem_total=g.mem_total,
            power_w=g.power_w, simulated=bool(g.simulated), error=g.error, worker=g.worker,
            lease_token=g.lease_token, session_id=g.session_id,
            session_status=info.status if info else None,
            session_step=info.step if info else None,
            session_loss=info.loss if info else None,
        ))
    decline = _last_decline(rd) if counters.get("sessions_declined") else None
    return Snapshot(rd.phase(), rows, counters, rd.heartbeat_age(time.time()), decline, rd.leader())


def _last_decline(rd: Reader, look_back: int = 500) -> str | None:
    """The newest session_declined event among the last `look_back` events, as one line."""
    for ev in rd.events(limit=look_back):
        if ev.kind == "session_declined":
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
    with Live(
        render_rich(gather(r, cluster), cluster), refresh_per_second=max(1, int(1 / interval_s))
    ) as live:
        while True:
            time.sleep(interval_s)
            try:
                live.update(render_rich(gather(r, cluster), cluster))
            except Exception as e:  # Redis blip: show it, keep going
                live.update(f"tailspec top: cannot read cluster state ({e})")
