"""Idle detection: one state machine per GPU, UNKNOWN → GENERATING → DRAINED → LENT → RECLAIMING.

Pure logic, no Redis and no clock of its own: `IdleDetector.tick(now, phase, progress, telemetry,
stopped_sessions)` looks at one snapshot of the cluster state and returns the actions to take (lend,
revoke, reclaimed). The scheduler service executes them; the property tests drive the same code with
random event sequences. A tick steps only the machines whose step could decide something new
(scheduler/idle_index.py); `incremental=False` steps every machine, with the same decisions.

Rules (docs/architecture.md):
- A GPU is DRAINED when its rollout worker reports no active request in the current rollout step.
  It is *idle* once a telemetry sample taken after the drain shows utilization below the threshold and
  nothing above it has been seen for `window_s` (telemetry confirms nothing else is using the GPU).
  A worker that reports its memory released (`mem_released=True`) makes its GPU idle at once
  (`lend_on_release`): the window waits out utilisation averaged over a sampling period from before the
  drain and tells a drained GPU from one between requests, and a worker that gave its memory back has
  said both itself. A sample after the drain at or above the threshold (someone else computing there)
  still puts the GPU back on the window, and a GPU is not lent again at the tick its last session ended.
- It is lent only while the rollout phase goes on and the expected remaining tail exceeds the session
  start-up cost, and only once the memory handshake allows it: a worker that reports `mem_released=False`
  (or none, under `require_release`) holds its GPU memory and is not lent; the free memory (telemetry's,
  and the worker's own report when it gives one: the smaller) must cover `min_free_bytes` and the largest
  footprint a session reported (`learn_need`).
- A lent GPU is revoked at the first snapshot where the phase is no longer rollout, its worker is
  generating again (or gone, or in another step), or its telemetry is lost or failing. After
  `stop_deadline_s` it counts as reclaimed whether or not its session has confirmed the stop.
- No telemetry, a telemetry error or no worker owning the GPU → UNKNOWN, never lent.

Only a drained GPU's step reads a telemetry sample's values (utilisation, memory, its time); every other step looks
at whether the GPU's telemetry is there and failing. `IdleDetector.sampled` names the GPUs whose step at a tick may
read values; for the others the caller may pass a `Health` instead of a sample, with the same decisions
(tests/test_scheduler_idle_incremental.py), so the scheduler reads and decodes only those GPUs' samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from tailspec.core.state import GpuState, GpuTelemetry, PhaseInfo, Progress
from tailspec.scheduler.idle_index import StepIndex

GpuKey = tuple[str, int]


@dataclass(frozen=True)
class Action:
    kind: Literal["lend", "revoke", "reclaimed", "idle"]
    node: str
    gpu: int
    reason: str = ""
    token: int | None = None
    session_id: str | None = None
    latency_s: float | None = None  # idle: drain → detection; reclaimed: revoke → reclaimed


@dataclass(frozen=True, slots=True)
class Health:
    """A GPU's telemetry as a step that reads no sample's values sees it: there, and its error if it failed. It has
    no values, so a step that would read one fails loudly instead of deciding on a made-up sample."""

    error: str | None = None


@dataclass(slots=True)
class GpuMachine:
    node: str
    gpu: int
    state: GpuState = GpuState.UNKNOWN
    since: float = 0.0
    worker: str | None = None
    step: int | None = None  # rollout step in which the GPU drained
    drained_at: float | None = None  # worker's report time of the drain
    last_high: float | None = None  # last telemetry time at/above the threshold since the drain
    low_since: float | None = None  # start of the current low-utilization stretch after the drain
    detected_at: float | None = None  # when idleness was confirmed
    lease_token: int | None = None
    session_id: str | None = None
    lent_at: float | None = None
    revoked_at: float | None = None
    revoke_reason: str | None = None
    floor: float = 0.0  # a drain is not dated before the last reclaim (the session was using the GPU)

    @property
    def key(self) -> GpuKey:
        return (self.node, self.gpu)

    def _enter(self, st: GpuState, now: float) -> None:
        if st != self.state:
            self.state, self.since = st, now

    def _forget_drain(self) -> None:
        self.step = self.drained_at = self.last_high = self.low_since = self.detected_at = None

    def hold_until(self, until: float) -> None:
        """Not lent again before `until`: a drain is dated no earlier, and one already seen waits a fresh window."""
        self.floor = max(self.floor, until)
        if self.state == GpuState.DRAINED and self.drained_at is not None:
            self.drained_at = max(self.drained_at, until)
            self.low_since = self.detected_at = None

    def lend_to(self, token: int, session_id: str, now: float) -> None:
        """The lease was granted and the session started on this drained GPU."""
        if self.state != GpuState.DRAINED:
            raise RuntimeError(f"GPU {self.node}:{self.gpu} lent from state {self.state.value}, expected drained")
        self.lease_token, self.session_id, self.lent_at = token, session_id, now
        self._enter(GpuState.LENT, now)


def expected_tail_s(now: float, phase: PhaseInfo | None, progress: Iterable[Progress]) -> float:
    """Expected remaining rollout time. A worker may report its own estimate (`remaining_s`); otherwise
    the estimate is the phase's elapsed time — for heavy-tailed lengths the expected residual life of a
    request grows with its age (a request still running after t is expected to run about t more)."""
    if phase is None or phase.phase != "rollout":
        return 0.0
    best = 0.0
    for p in progress:
        if p.phase != "rollout" or p.step != phase.step or p.active == 0:
            continue
        est = p.remaining_s if p.remaining_s is not None else max(0.0, now - phase.started_at)
        best = max(best, est)
    return best


class _Tail:
    """expected_tail_s of one tick, computed when a lend first asks for it (most ticks lend nothing)."""

    __slots__ = ("_reason", "_value", "now", "phase", "progress")

    def __init__(self, now: float, phase: PhaseInfo | None, progress: Iterable[Progress]) -> None:
        self.now, self.phase, self.progress = now, phase, progress
        self._value: float | None = None
        self._reason = ""

    @property
    def value(self) -> float:
        if self._value is None:
            self._value = expected_tail_s(self.now, self.phase, self.progress)
            self._reason = f"expected tail {self._value:.2f}s"
        return self._value

    @property
    def reason(self) -> str:
        self.value  # noqa: B018 - computes it (and the reason) on first use
        return self._reason


@dataclass
class IdleDetector:
    util_threshold: float = 10.0
    window_s: float = 0.2
    startup_s: float = 0.5
    stop_deadline_s: float = 1.0
    lend: bool = True  # False: detect and count idle time, never lend (baseline runs)
    require_release: bool = False  # a worker that never reported mem_released is not lent either
    lend_on_release: bool = True  # a worker's mem_released=True makes its GPU idle without the window
    min_free_bytes: int = 0
    mem_needed: int = 0  # the largest footprint a session computed (learn_need): a GPU with less free is not lent
    # False: every machine is stepped at every tick. True: only those whose step could decide something new
    # (scheduler/idle_index.py); the same decisions, which tests/test_scheduler_idle_incremental.py checks.
    incremental: bool = True
    machines: dict[GpuKey, GpuMachine] = field(default_factory=dict)
    index: StepIndex = field(default_factory=StepIndex, repr=False)

    def learn_need(self, nbytes: int) -> None:
        """A session computed it needs `nbytes` of GPU memory: do not lend a GPU with less free again."""
        self.mem_needed = max(self.mem_needed, int(nbytes))

    def memory_hold(self, p: Progress, t: GpuTelemetry) -> str | None:
        """Why the memory handshake keeps this drained GPU from being lent, or None when it may be."""
        if p.mem_released is False or (p.mem_released is None and self.require_release):
            return "worker has not released its GPU memory"
        known = [x for x in (t.mem_total - t.mem_used if t.mem_total > 0 else None, p.free_mem) if x is not None]
        need = max(self.min_free_bytes, self.mem_needed)
        if need > 0 and known and min(known) < need:
            return f"{min(known) / 2**30:.2f} GiB free < {need / 2**30:.2f} GiB needed"
        return None

    def machine(self, node: str, gpu: int) -> GpuMachine:
        m = self.machines.get((node, gpu))
        if m is None:
            m = self.machines[(node, gpu)] = GpuMachine(node, gpu)
            self.index.added((node, gpu))
        return m

    def count(self, *states: GpuState) -> int:
        """Machines in any of `states`."""
        return self.index.count(*states)

    def keys_in(self, st: GpuState) -> set[GpuKey]:
        """The machines in state `st` (the index's own set: do not change it)."""
        return self.index.by_state[st]

    def sampled(self, phase: PhaseInfo | None, progress: Mapping[str, Progress],
                stopped_sessions: set[str] | frozenset[str] = frozenset()) -> set[GpuKey]:
        """The GPUs whose step at a tick on these inputs may read a telemetry sample's values: in a rollout, those a
        worker names while it reports no active request in a rollout phase, except GPUs lent to a session that has
        not stopped (a lent GPU's step looks only at whether its telemetry is usable). A superset of the GPUs whose
        step reaches the drained branch; for every other GPU a `Health` decides as its sample would."""
        if phase is None or phase.phase != "rollout":
            return set()
        self.index.owners(progress)
        return self.index.sampled(stopped_sessions)

    def changed(self) -> list[GpuKey]:
        """Machines stepped or changed since the last call, in creation order: the only ones whose state or
        since can differ from what the last call's caller saw."""
        return self.index.take_changed()

    def tick(
        self,
        now: float,
        phase: PhaseInfo | None,
        progress: Mapping[str, Progress],
        telemetry: Mapping[GpuKey, GpuTelemetry | Health],
        stopped_sessions: set[str] | frozenset[str] = frozenset(),
    ) -> list[Action]:
        """Step the machines (all, or those whose step could decide something new) on this snapshot; returns
        the actions in the machines' creation order. The mappings' values are treated as immutable snapshots;
        a GPU outside `sampled(phase, progress, stopped_sessions)` may have a `Health` for its sample."""
        owner = self.index.owners(progress)
        machines = self.machines
        for k in self.index.unseen(telemetry, owner, machines):  # a GPU seen for the first time
            if k not in machines:
                self.machine(*k)
        due = self.index.due(now, phase, owner, telemetry, stopped_sessions, everything=not self.incremental)
        actions: list[Action] = []
        if not due:
            return actions
        rollout = phase is not None and phase.phase == "rollout"
        tail = _Tail(now, phase, progress.values())
        step, stepped, deadline_s = self._step, self.index.stepped, self.stop_deadline_s
        for k in due:
            m = machines[k]
            old, sid = m.state, m.session_id
            step(m, now, phase, rollout, tail, owner.get(k), telemetry.get(k), stopped_sessions, actions)
            if m.state != old or m.session_id != sid or m.state == GpuState.RECLAIMING:
                stepped(k, old, m.state, sid, m.session_id,
                        None if m.revoked_at is None else m.revoked_at + deadline_s)
        return actions

    def step_one(
        self,
        m: GpuMachine,
        now: float,
        phase: PhaseInfo | None,
        progress: Mapping[str, Progress],
        telemetry: GpuTelemetry | Health | None,
        stopped_sessions: set[str] | frozenset[str] = frozenset(),
    ) -> list[Action]:
        """Step one machine the caller owns (not one of `machines`) on a snapshot, by the rules a tick applies, without
        the tick's bookkeeping of which machines are due: for a caller that knows the moments a GPU's inputs change
        (the cluster projection, tailspec/simulate/lending.py). Its owner is the last report in `progress` naming it."""
        owner = None
        for p in progress.values():
            if p.node == m.node and m.gpu in p.gpus:
                owner = p
        rollout = phase is not None and phase.phase == "rollout"
        return self._step(m, now, phase, rollout, _Tail(now, phase, progress.values()), owner, telemetry,
                          stopped_sessions)

    def _step(
        self,
        m: GpuMachine,
        now: float,
        phase: PhaseInfo | None,
        rollout: bool,
        tail: _Tail,
        p: Progress | None,
        t: GpuTelemetry | Health | None,
        stopped: set[str] | frozenset[str],
        out: list[Action] | None = None,
    ) -> list[Action]:
        """Step one GPU's machine; its actions are appended to `out` (a new list if None), which is returned."""
        if out is None:
            out = []
        t_ok = t is not None and t.error is None
        generating = p is not None and p.active > 0
        drained = (
            rollout
            and p is not None
            and p.active == 0
            and p.phase == "rollout"
            and phase is not None
            and p.step == phase.step
        )

        if m.state == GpuState.LENT:
            if m.session_id is not None and m.session_id in stopped:
                out.append(self._reclaim(m, now, "session ended"))
            else:
                reason = _revoke_reason(rollout, p, t, generating, drained)
                if reason is not None:
                    m._enter(GpuState.RECLAIMING, now)
                    m.revoked_at, m.revoke_reason = now, reason
                    out.append(Action("revoke", m.node, m.gpu, reason, m.lease_token, m.session_id))
        if m.state == GpuState.RECLAIMING:
            assert m.revoked_at is not None
            if m.session_id is not None and m.session_id in stopped:
                out.append(self._reclaim(m, now, "session stopped"))
            elif now - m.revoked_at >= self.stop_deadline_s:
                out.append(self._reclaim(m, now, "stop deadline passed"))
        if m.state in (GpuState.LENT, GpuState.RECLAIMING):
            return out

        m.worker = p.worker if p is not None else None
        if not t_ok or p is None:
            m._forget_drain()
            m._enter(GpuState.UNKNOWN, now)
        elif generating:
            m._forget_drain()
            m._enter(GpuState.GENERATING, now)
        elif drained:
            # a Health marker has no values to read: fail loudly (the projection passes its own sample type)
            assert phase is not None and t is not None and not isinstance(t, Health), \
                "a drained GPU's step reads its sample"
            self._step_drained(m, now, phase, tail, p, t, out)
        else:
            m._forget_drain()
            m._enter(GpuState.UNKNOWN, now)
        return out

    def _step_drained(
        self,
        m: GpuMachine,
        now: float,
        phase: PhaseInfo,
        tail: _Tail,
        p: Progress,
        t: GpuTelemetry,
        out: list[Action],
    ) -> None:
        """A drained GPU: idle once its utilisation stayed low for the window; lent when the tail is long enough
        and its memory is free."""
        if m.state != GpuState.DRAINED or m.step != phase.step:
            m._forget_drain()
            m.step, m.drained_at = phase.step, max(p.ts, m.floor)
            m._enter(GpuState.DRAINED, now)
        assert m.drained_at is not None
        # Low since the drain unless telemetry saw it busy after the drain; then low since the
        # first low sample after that.
        if t.ts >= m.drained_at and t.util >= self.util_threshold:
            m.last_high, m.low_since, m.detected_at = t.ts, None, None
        elif t.ts >= m.drained_at and m.low_since is None:
            m.low_since = t.ts if m.last_high is not None else m.drained_at
        low_since = m.low_since
        # not at the tick of a reclaim or inside a back-off (floor): what the ended session taught (its memory
        # need, a failure's back-off) is applied after the tick that saw it end
        released = self.lend_on_release and p.mem_released is True and m.last_high is None and now > m.floor
        idle = released or (
            low_since is not None
            and t.ts >= low_since
            and t.util < self.util_threshold
            and now - low_since >= self.window_s
        )
        if idle and m.detected_at is None:
            m.detected_at = now
            out.append(Action("idle", m.node, m.gpu, latency_s=now - m.drained_at))
        if idle and self.lend and tail.value > self.startup_s and self.memory_hold(p, t) is None:
            out.append(Action("lend", m.node, m.gpu, tail.reason))

    def _reclaim(self, m: GpuMachine, now: float, reason: str) -> Action:
        latency = now - m.revoked_at if m.revoked_at is not None else None
        a = Action("reclaimed", m.node, m.gpu, reason, m.lease_token, m.session_id, latency)
        m.lease_token = m.session_id = m.lent_at = m.revoked_at = m.revoke_reason = None
        m._forget_drain()  # a fresh window before lending again
        m.floor = now
        m._enter(GpuState.UNKNOWN, now)
        return a

    def back_off(self, node: str, gpu: int, until: float) -> None:
        """Do not lend this GPU again before `until` (its session failed to start or crashed)."""
        m = self.machine(node, gpu)
        self.index.touched(m.key)
        m.hold_until(until)

    def lent(self, node: str, gpu: int, token: int, session_id: str, now: float) -> None:
        """The service got the lease and started the session."""
        m = self.machine(node, gpu)
        m.lend_to(token, session_id, now)
        self.index.moved(m.key, GpuState.DRAINED, GpuState.LENT)
        self.index.lent(m.key, session_id)


def _revoke_reason(rollout: bool, p: Progress | None, t: GpuTelemetry | Health | None, generating: bool,
                   drained: bool) -> str | None:
    """Why a lent GPU must be given back now, or None while it may stay lent."""
    if not rollout:
        return "phase ended"
    if p is None:
        return "worker progress lost"
    if generating:
        return "worker generating"
    if not drained:
        return "worker left the rollout step"
    if t is None:
        return "telemetry lost"
    if t.error is not None:
        return f"telemetry error: {t.error}"
    return None
