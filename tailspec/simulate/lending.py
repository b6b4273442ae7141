"""Which drained replicas the scheduler lends, decided by the scheduler's own idle state machine.

Each replica's GPUs are state machines (`GpuMachine`) stepped by the rules of the `IdleDetector` the service runs
(scheduler/idle.py, `step_one`: a tick's rules without its index of which machines are due) at the moments that
matter instead of every `tick_s`: when the scheduler can first call the replica idle (its
drain report seen, a low telemetry sample after it, the idle window passed), when it reads the phase change
(revoke) and when the session has stopped (reclaimed). Between those moments the detector's inputs do not
change, so the extra ticks of the real loop would return nothing. The expected remaining tail it lends on is
the service's: the phase's elapsed time while any replica still decodes.

The idle GPU-seconds the scheduler counts (scheduler/service.py `_lead`: each tick adds its interval for every
GPU DRAINED or LENT when the tick began) run from the tick that reads the drain report to the tick that reads
the phase change, the counting window `Lending.seen` → `Lending.phase_seen`. A worker reports its drain before
it builds its result (`lead_s`), the trainer changes the phase some time after the last result (`phase_s`
holds that lag), and the scheduler reads both at its next tick. Two reads on one tick grid with an offset
uniform over the tick: the expected ticks between them are their distance, so the idle window's expected
length is `phase_seen - seen` whatever the tick, and the last replica counts too (its drain precedes the
phase change).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tailspec.core.state import PhaseInfo
from tailspec.scheduler.idle import GpuMachine, IdleDetector


@dataclass(frozen=True)
class Latencies:
    """The scheduler's delays, in seconds (defaults: the config's defaults; `tailspec bench scheduler`
    measures them on a machine)."""

    see_s: float = 0.1  # drain → the scheduler has read the worker's report (report period / 2 + tick / 2)
    # rollout done (the last result) → the scheduler has read the phase change: the trainer's lag + tick / 2
    phase_s: float = 0.025
    lead_s: float = 0.0  # a replica's drain report → its last request's result (the worker builds its result)
    telemetry_s: float = 0.1  # drain → the first telemetry sample after it (sample period / 2)
    window_s: float = 0.2  # idle window (scheduler.idle_window_s)
    tick_s: float = 0.05
    startup_s: float = 0.5  # lend only if the expected tail is longer (scheduler.session_startup_s)
    stop_s: float = 0.2  # revoke → session stopped and GPU free
    # the worker reports its memory released at the drain and the scheduler lends on that report without the
    # window (scheduler.lend_on_release); False: telemetry and the window decide
    on_release: bool = True

    @property
    def detect_s(self) -> float:
        if self.on_release:
            return self.see_s + self.tick_s / 2
        return max(self.see_s, self.telemetry_s, self.window_s) + self.tick_s / 2


@dataclass
class Lending:
    """Per replica, seconds from the rollout's start (NaN: never)."""

    seen: np.ndarray  # the scheduler counts the replica idle from here (DRAINED)
    phase_seen: float  # ... to here: it reads the phase change (revokes; DRAINED and LENT stop counting)
    lent: np.ndarray  # lease granted, session starting
    revoked: np.ndarray
    reclaimed: np.ndarray


@dataclass(frozen=True, slots=True)
class _Report:
    """A worker's progress report as the idle state machine reads it (the fields of state.Progress):
    built a few thousand times per simulated step, where validating a pydantic model would cost more than
    the state machine itself."""

    worker: str
    gpus: tuple[int, ...]
    active: int
    step: int
    ts: float
    node: str = "sim"
    phase: str = "rollout"
    remaining_s: float | None = None
    mem_released: bool | None = True  # the engine freed its memory at the drain (vLLM sleep)
    free_mem: int | None = None


@dataclass(frozen=True, slots=True)
class _Sample:
    """A telemetry sample as the idle state machine reads it (the fields of state.GpuTelemetry)."""

    gpu: int
    util: float
    ts: float
    node: str = "sim"
    error: str | None = None
    simulated: bool = True
    mem_used: int = 0
    mem_total: int = 0  # 0: unknown (the session's own memory check is not modelled)


def decide(finish: np.ndarray, phase_end: float, tp: int, lat: Latencies, lend: bool, step: int = 0) -> Lending:
    """Run each replica's idle state machine through one rollout phase [0, phase_end]; `finish[r]` is when
    replica r's last request finished (its GPUs drain then, its drain report `lat.lead_s` before)."""
    nan = np.full(len(finish), np.nan)
    end = phase_end + lat.phase_s  # the scheduler reads the phase change
    seen = finish - lat.lead_s + lat.see_s
    out = Lending(np.where(seen < end, seen, np.nan), end, nan.copy(), nan.copy(), nan.copy())
    if not lend:  # a watching scheduler only counts the idle time
        return out
    order = np.sort(finish)
    phase = PhaseInfo.model_construct(phase="rollout", step=step, started_at=0.0, policy_version=0, policy_path=None)
    ended = PhaseInfo.model_construct(phase="train", step=step, started_at=end, policy_version=0, policy_path=None)
    gpus = tuple(range(tp))
    # one detector's rules and settings; each replica's GPUs are their own machines, stepped at the three moments
    det = IdleDetector(window_s=lat.window_s, startup_s=lat.startup_s, stop_deadline_s=max(lat.stop_s, 1e-3) * 4,
                       lend=lend, lend_on_release=lat.on_release)
    step_one = det.step_one
    report = finish - lat.lead_s  # each replica's drain report
    nows = report + lat.detect_s
    stills = len(order) - np.searchsorted(order, nows + lat.lead_s, side="right")  # replicas not drained at `now`
    for r, (f, now, still) in enumerate(zip(report.tolist(), nows.tolist(), stills.tolist())):
        if now >= end:
            continue
        machines = [GpuMachine("sim", g) for g in gpus]
        progress = {"r": _Report("r", gpus, 0, step, f), "others": _Report("others", (), still, step, now)}
        tel = _Sample(0, 0.0, f + lat.telemetry_s)  # every GPU of the replica: one sample's values
        acts = [a for m in machines for a in step_one(m, now, phase, progress, tel)]  # type: ignore[arg-type]
        if not any(a.kind == "lend" for a in acts):
            continue
        sid = f"s{r}"
        for m in machines:
            m.lend_to(1, sid, now)
        out.lent[r] = now
        acts = [a for m in machines for a in step_one(m, end, ended, progress, tel)]  # type: ignore[arg-type]
        if not any(a.kind == "revoke" for a in acts):
            raise AssertionError("the idle state machine kept a GPU lent past the phase end")
        out.revoked[r] = end
        acts = [a for m in machines for a in step_one(m, end + lat.stop_s, ended, progress, tel, {sid})]  # type: ignore[arg-type]
        out.reclaimed[r] = next((end + a.latency_s for a in acts if a.kind == "reclaimed" and a.latency_s),
                                end + lat.stop_s)
    return out
