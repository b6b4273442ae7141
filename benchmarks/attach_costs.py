"""Where an attached TRL step's extra time goes (bench attach): the attachment's own time on each rank's trainer
thread by cause (the `seconds` of tailspec.integrations.trl.AttachStats: policy publish, set_phase, the progress
hook, wait_reclaimed, sample submission, the last flush), and the host CPU that runs beside the ranks only when
attached (the scheduler's loop in the bench's process, redis-server, the session processes), read from /proc.

`breakdown` puts them beside the measured overhead (attached step − unattached step, per step): what the trainer
threads account for, and what is left (`unlocated_s`), which host CPU taken from the ranks' cores can explain.
`reclaim_parts` splits each `wait_reclaimed` that waited for a session by the cluster's records: until the
scheduler's revoke (the phase written, the scheduler's next tick), until the session freed its GPU (the push, the
unit of work in flight, the release), and until the trainer saw it (its poll).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any

from tailspec.core import state
from tailspec.core.state import Event, SessionInfo

SESSION_CMD = "tailspec.scheduler.session_process"
TRAINER_CAUSES = ("publish", "phase", "progress", "wait_reclaimed", "submit", "flush")


@dataclass(frozen=True)
class HostCpu:
    """CPU seconds taken beside the trainer's ranks: the scheduler (this process: its loop and dispatcher run here
    in bench attach), redis-server, and every session process."""

    scheduler: float
    redis: float
    sessions: float

    def __sub__(self, other: HostCpu) -> HostCpu:
        return HostCpu(self.scheduler - other.scheduler, self.redis - other.redis, self.sessions - other.sessions)


def host_cpu(redis_pid: int | None) -> HostCpu:
    """The CPU seconds used so far by this process, the redis-server `redis_pid` and this process's session
    process descendants (a session process's CPU counts from its start)."""
    sessions = sum(_cpu(pid) for pid in descendants(os.getpid()) if SESSION_CMD in _cmdline(pid))
    return HostCpu(_cpu(os.getpid()), _cpu(redis_pid) if redis_pid else 0.0, sessions)


def trainer_seconds(summaries: list[dict]) -> dict[str, float]:
    """Per cause, the most any rank's trainer thread spent on it in the run (the ranks meet at every collective, so
    the slowest rank's time is what a step waits for)."""
    return {c: max((s["tailspec"].get("seconds", {}).get(c, 0.0) for s in summaries), default=0.0)
            for c in TRAINER_CAUSES}


def breakdown(overhead_s: list[float], trainer: list[dict[str, float]], cpu: list[HostCpu], steps: int) -> dict:
    """Medians over repeats, per optimizer step: the overhead (s), the trainer threads' time by cause (s), their
    sum, what is left of the overhead (`unlocated_s`), and the host CPU beside the ranks (CPU-s) by part."""
    per_step = [{c: v / steps for c, v in t.items()} for t in trainer]
    located = [sum(t.values()) for t in per_step]
    return {
        "overhead_s": _median(overhead_s),
        "trainer_thread_s": {c: _median([t[c] for t in per_step]) for c in TRAINER_CAUSES},
        "trainer_thread_total_s": _median(located),
        "unlocated_s": _median([o - t for o, t in zip(overhead_s, located)]),
        "host_cpu_s": {"scheduler": _median([c.scheduler / steps for c in cpu]),
                       "redis": _median([c.redis / steps for c in cpu]),
                       "sessions": _median([c.sessions / steps for c in cpu])},
    }


def reclaim_parts(r: Any, cluster: str, waits: list[dict]) -> list[dict[str, float]]:
    """For each wait (an AttachStats wait: `returned_at`, `waited_s`) in which the scheduler revoked a lease: seconds
    from the wait's start to the revoke ("scheduler"), from the revoke to the session's release ("session") and from
    the release to the wait's end ("trainer")."""
    events, _ = state.read_stream(r, state.key(cluster, "events"), Event)
    revokes = sorted(e.ts for _, e in events if e.kind == "lease_revoked")
    sids = [s.decode() for s in r.smembers(state.key(cluster, "sessions"))]
    infos = [state.get(r, state.key(cluster, "session", session_id=sid), SessionInfo) for sid in sids]
    freed = sorted(t for i in infos if i is not None and (t := i.released_at or i.stopped_at) is not None)
    out = []
    for w in waits:
        start, end = w["returned_at"] - w["waited_s"], w["returned_at"]
        rv = [t for t in revokes if start <= t <= end]
        if not rv:
            continue
        rel = [t for t in freed if rv[0] <= t <= end]
        released = max(rel) if rel else end
        out.append({"scheduler": rv[0] - start, "session": released - rv[0], "trainer": end - released})
    return out


def parts_summary(parts: list[dict[str, float]]) -> dict:
    """Median and max of each part over the waits."""
    return {k: {"median": _median([p[k] for p in parts]), "max": max((p[k] for p in parts), default=0.0)}
            for k in ("scheduler", "session", "trainer")} | {"waits": len(parts)}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    """utime + stime of `pid` in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return 0.0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, read from /proc (children before grandchildren)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(0), []):
            found.append(c)
            todo.append(c)
    return found
