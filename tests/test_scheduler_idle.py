"""Idle detection: the per-GPU state machine, unit cases and hypothesis property tests over random
sequences of progress / telemetry / phase / session events."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from tailspec.core.state import GpuState, GpuTelemetry, PhaseInfo, Progress
from tailspec.scheduler.idle import Health, IdleDetector, expected_tail_s

N = "n0"


def prog(w: int, active: int, ts: float, step: int = 1, phase: str = "rollout", remaining_s=None) -> Progress:
    return Progress(
        worker=f"w{w}",
        node=N,
        gpus=[w],
        active=active,
        finished=0,
        phase=phase,
        step=step,
        remaining_s=remaining_s,
        ts=ts,
    )


def tel(g: int, util: float, ts: float, error: str | None = None) -> GpuTelemetry:
    return GpuTelemetry(node=N, gpu=g, util=util, mem_used=0, mem_total=1, simulated=True, error=error, ts=ts)


def rollout(step: int = 1, started: float = 0.0) -> PhaseInfo:
    return PhaseInfo(phase="rollout", step=step, started_at=started)


def test_drained_gpu_is_lent_after_the_window_and_revoked_at_phase_end():
    d = IdleDetector(util_threshold=10, window_s=0.2, startup_s=0.5, stop_deadline_s=1.0)
    ph = rollout(started=0.0)
    p = {"w0": prog(0, 3, 1.0), "w1": prog(1, 2, 1.0)}
    t = {(N, 0): tel(0, 90, 1.0), (N, 1): tel(1, 90, 1.0)}
    assert d.tick(1.0, ph, p, t) == []
    assert d.machines[(N, 0)].state == GpuState.GENERATING
    p["w0"] = prog(0, 0, 2.0)  # worker 0 drained at t=2.0
    t[(N, 0)] = tel(0, 1.0, 2.05)
    assert [a.kind for a in d.tick(2.1, ph, p, t)] == []  # window not over
    assert d.machines[(N, 0)].state == GpuState.DRAINED
    acts = d.tick(2.25, ph, p, t)
    assert [a.kind for a in acts] == ["idle", "lend"]
    assert abs(acts[0].latency_s - 0.25) < 1e-9
    d.lent(N, 0, token=7, session_id="s7", now=2.25)
    assert d.machines[(N, 0)].state == GpuState.LENT
    assert d.tick(2.5, ph, p, t) == []  # stays lent, no second lend
    acts = d.tick(3.0, PhaseInfo(phase="train", step=1, started_at=3.0), p, t)
    assert [(a.kind, a.token, a.reason) for a in acts] == [("revoke", 7, "phase ended")]
    assert d.machines[(N, 0)].state == GpuState.RECLAIMING
    acts = d.tick(3.2, None, p, t, stopped_sessions={"s7"})
    assert [(a.kind, a.session_id) for a in acts] == [("reclaimed", "s7")]
    assert abs(acts[0].latency_s - 0.2) < 1e-9
    assert d.machines[(N, 0)].state == GpuState.UNKNOWN


def test_sampled_names_the_gpus_whose_step_reads_a_sample():
    """The GPUs whose sample the scheduler reads: drained workers' GPUs in a rollout, not a lent one while its session
    goes on, a reclaiming one (reclaimed, it may drain again in the same step), never outside a rollout."""
    d = IdleDetector(window_s=0.0, startup_s=0.0, stop_deadline_s=1.0)
    ph = rollout()
    p = {"w0": prog(0, 0, 1.0), "w1": prog(1, 1, 1.0), "w2": prog(2, 0, 1.0, phase="train")}
    assert d.sampled(ph, p) == {(N, 0)}  # not w1's (generating) nor w2's (its report is not a rollout's)
    assert d.sampled(PhaseInfo(phase="train", step=1, started_at=0.0), p) == set()
    assert d.sampled(None, p) == set()
    t = {(N, 0): tel(0, 0, 1.1), (N, 1): Health(), (N, 2): Health()}  # a Health where the step reads no sample
    assert [a.kind for a in d.tick(1.2, ph, p, t)] == ["idle", "lend"]
    d.lent(N, 0, 1, "s1", 1.2)
    assert d.sampled(ph, p) == set()  # lent: its step looks only at whether its telemetry is usable
    assert d.sampled(ph, p, {"s1"}) == {(N, 0)}  # its session ended: reclaimed, then drained, at this tick
    p["w0"] = prog(0, 2, 1.3)
    assert [a.reason for a in d.tick(1.3, ph, p, {**t, (N, 0): Health()})] == ["worker generating"]
    p["w0"] = prog(0, 0, 1.4)
    assert d.sampled(ph, p) == {(N, 0)}  # reclaiming, its worker drained again
    acts = d.tick(2.4, ph, p, {**t, (N, 0): tel(0, 0, 2.2)})
    assert [(a.kind, a.reason) for a in acts] == [("reclaimed", "stop deadline passed")]
    assert d.machines[(N, 0)].state == GpuState.DRAINED


def test_high_utilization_after_drain_blocks_lending():
    """Telemetry confirms the drain: a GPU still busy (e.g. weight sync) is not lent."""
    d = IdleDetector(window_s=0.2, startup_s=0.0)
    ph = rollout()
    p = {"w0": prog(0, 0, 1.0), "w1": prog(1, 2, 1.0)}  # w1 still generates: there is a tail
    assert d.tick(1.5, ph, p, {(N, 0): tel(0, 80, 1.4)}) == []
    assert d.tick(1.65, ph, p, {(N, 0): tel(0, 2, 1.6)}) == []  # low since 1.6 only
    assert [a.kind for a in d.tick(1.81, ph, p, {(N, 0): tel(0, 2, 1.8)})] == ["idle", "lend"]


def test_released_memory_makes_a_drained_gpu_idle_at_once():
    """A worker that reports its memory released is lendable at the first tick after its drain, with only
    samples from before the drain; a busy sample after the drain puts it back on the window; with
    lend_on_release off, or mem_released not True, the window applies."""
    ph = rollout()
    released = {"w0": prog(0, 0, 2.0).model_copy(update={"mem_released": True}), "w1": prog(1, 2, 2.0)}
    old = {(N, 0): tel(0, 90, 1.9)}  # taken while the worker still decoded
    assert [a.kind for a in IdleDetector(window_s=0.2, startup_s=0.0).tick(2.01, ph, released, old)] == ["idle", "lend"]
    # without the handshake (False, None) or with the rule off: the window, from a sample after the drain
    for p, det in ((dict(released, w0=prog(0, 0, 2.0)), IdleDetector(window_s=0.2, startup_s=0.0)),
                   (released, IdleDetector(window_s=0.2, startup_s=0.0, lend_on_release=False))):
        assert det.tick(2.01, ph, p, old) == []
        assert det.tick(2.1, ph, p, {(N, 0): tel(0, 1, 2.05)}) == []
        assert [a.kind for a in det.tick(2.21, ph, p, {(N, 0): tel(0, 1, 2.2)})] == ["idle", "lend"]
    # released, but a sample after the drain shows the GPU busy: the window from the next low sample
    d = IdleDetector(window_s=0.2, startup_s=0.0)
    assert d.tick(2.1, ph, released, {(N, 0): tel(0, 80, 2.05)}) == []
    assert d.tick(2.2, ph, released, {(N, 0): tel(0, 1, 2.15)}) == []
    assert [a.kind for a in d.tick(2.36, ph, released, {(N, 0): tel(0, 1, 2.3)})] == ["idle", "lend"]


def test_tail_gate_and_worker_estimate():
    d = IdleDetector(window_s=0.0, startup_s=5.0)
    ph = rollout(started=0.0)
    p = {"w0": prog(0, 0, 1.0), "w1": prog(1, 4, 1.0)}
    t = {(N, 0): tel(0, 0, 1.1)}
    assert [a.kind for a in d.tick(2.0, ph, p, t)] == ["idle"]  # tail 2 s (phase age) < 5 s start-up
    assert [a.kind for a in d.tick(6.0, ph, p, t)] == ["lend"]  # age 6 s
    p["w1"] = prog(1, 4, 6.0, remaining_s=1.0)  # the worker knows better: 1 s left
    assert d.tick(6.1, ph, p, t) == []
    assert expected_tail_s(6.1, ph, p.values()) == 1.0
    assert expected_tail_s(6.1, None, p.values()) == 0.0


def test_telemetry_error_makes_gpu_unknown_and_revokes():
    d = IdleDetector(window_s=0.0, startup_s=0.0)
    ph = rollout()
    p = {"w0": prog(0, 0, 1.0), "w1": prog(1, 0, 1.0), "w2": prog(2, 1, 1.0)}
    t = {(N, 0): tel(0, 0, 1.1), (N, 1): tel(1, 0, 1.1, error="NVML: GPU is lost")}
    acts = d.tick(1.2, ph, p, t)
    assert [(a.kind, a.gpu) for a in acts] == [("idle", 0), ("lend", 0)]  # GPU 1 never lent
    assert d.machines[(N, 1)].state == GpuState.UNKNOWN
    d.lent(N, 0, 1, "s1", 1.2)
    t[(N, 0)] = tel(0, 50, 1.3, error="NVML: Unknown Error")
    acts = d.tick(1.3, ph, p, t)
    assert [(a.kind, a.gpu) for a in acts] == [("revoke", 0)]
    assert acts[0].reason.startswith("telemetry error")


def test_reclaim_after_deadline_without_session_confirmation():
    d = IdleDetector(window_s=0.0, startup_s=0.0, stop_deadline_s=1.0)
    p = {"w0": prog(0, 0, 1.0), "w1": prog(1, 1, 1.0)}
    t = {(N, 0): tel(0, 0, 1.0)}
    d.tick(1.0, rollout(), p, t)
    d.lent(N, 0, 3, "s3", 1.0)
    p["w0"] = prog(0, 5, 1.5)  # new requests for this worker: give the GPU back
    assert [a.reason for a in d.tick(1.5, rollout(), p, t)] == ["worker generating"]
    assert d.tick(2.4, rollout(), p, t) == []
    acts = d.tick(2.5, rollout(), p, t)
    assert [(a.kind, a.reason) for a in acts] == [("reclaimed", "stop deadline passed")]
    assert d.machines[(N, 0)].state == GpuState.GENERATING


# -- property tests ----------------------------------------------------------------------------------
W = 3  # workers, one GPU each

# Kinds weighted so that drains, busy workers and ticks dominate (lends happen), with every fault mixed in.
_KINDS = (
    ["busy"] * 4
    + ["drain"] * 4
    + ["tick"] * 5
    + ["progress", "tel", "tel_error", "phase", "session_ends", "worker_gone", "step_worker"]
)


@st.composite
def _event(draw):
    kind = draw(st.sampled_from(_KINDS))
    w = draw(st.integers(0, W - 1))
    if kind == "busy":
        return ("progress", w, draw(st.sampled_from([1, 4])))
    if kind == "progress":
        return ("progress", w, draw(st.sampled_from([0, 1, 4])))
    if kind == "tel":
        return ("tel", w, draw(st.sampled_from([0.0, 3.0, 50.0, 95.0])))
    if kind == "tick":
        return ("tick", draw(st.sampled_from([0.01, 0.05, 0.1, 0.3, 1.2])), 0)
    if kind == "phase":
        return ("phase", draw(st.sampled_from(["rollout", "train", "idle"])), 0)
    return (kind, w, 0)


events = st.lists(_event(), min_size=1, max_size=80)


@dataclass
class Harness:
    """Drives IdleDetector the way the scheduler service does, with an in-memory lease table."""

    d: IdleDetector
    now: float = 0.0
    phase: PhaseInfo | None = None
    step: int = 0
    progress: dict[str, Progress] = field(default_factory=dict)
    telemetry: dict = field(default_factory=dict)
    holders: dict[int, int] = field(default_factory=dict)  # gpu → token
    token: int = 0
    ended: set[str] = field(default_factory=set)
    phase_end_seen: float | None = None  # first tick that saw a non-rollout phase

    def tick(self) -> None:
        rollout_now = self.phase is not None and self.phase.phase == "rollout"
        acts = self.d.tick(self.now, self.phase, self.progress, self.telemetry, set(self.ended))
        if not rollout_now and self.phase_end_seen is None:
            self.phase_end_seen = self.now
        if rollout_now:
            self.phase_end_seen = None
        for a in acts:
            if a.kind == "lend":
                p = self.progress.get(f"w{a.gpu}")
                # never lend while the worker is generating, or outside the rollout phase
                assert rollout_now
                assert p is not None and p.active == 0 and p.step == self.phase.step
                t = self.telemetry.get((N, a.gpu))
                assert t is not None and t.error is None and t.util < self.d.util_threshold
                # at most one holder per GPU
                assert a.gpu not in self.holders
                self.token += 1
                self.holders[a.gpu] = self.token
                self.d.lent(N, a.gpu, self.token, f"s{self.token}", self.now)
            elif a.kind == "revoke":
                assert self.holders.get(a.gpu) == a.token
            elif a.kind == "reclaimed":
                assert self.holders.pop(a.gpu) == a.token
                self.ended.discard(a.session_id)
        # invariants after every tick
        for (node, g), m in self.d.machines.items():
            if m.state == GpuState.LENT:
                p = self.progress.get(f"w{g}")
                assert rollout_now and p is not None and p.active == 0 and p.step == self.phase.step
                assert self.holders.get(g) == m.lease_token
            if m.state not in (GpuState.LENT, GpuState.RECLAIMING):
                assert g not in self.holders
        if self.phase_end_seen is not None:
            # revoked at once, and reclaimed within the deadline of the first tick that saw the end
            assert not any(m.state == GpuState.LENT for m in self.d.machines.values())
            if self.now - self.phase_end_seen >= self.d.stop_deadline_s:
                assert not self.holders

    def apply(self, ev) -> None:
        kind, a, b = ev
        self.now += 0.001
        if kind in ("progress", "drain"):
            self.progress[f"w{a}"] = prog(
                a, b, self.now, step=self.step, phase=self.phase.phase if self.phase else "idle"
            )
            if kind == "drain":
                self.now += 0.001
                self.telemetry[(N, a)] = tel(a, 1.0, self.now)
        elif kind == "tel":
            self.telemetry[(N, a)] = tel(a, b, self.now)
        elif kind == "tel_error":
            self.telemetry[(N, a)] = tel(a, 0, self.now, error="NVML: GPU is lost")
        elif kind == "phase":
            if a == "rollout":
                self.step += 1
            self.phase = PhaseInfo(phase=a, step=self.step, started_at=self.now)
        elif kind == "tick":
            self.now += a
            self.tick()
        elif kind == "session_ends":
            tok = self.holders.get(a)
            if tok is not None:
                self.ended.add(f"s{tok}")
        elif kind == "worker_gone":
            self.progress.pop(f"w{a}", None)
        elif kind == "step_worker" and f"w{a}" in self.progress:
            p = self.progress[f"w{a}"]
            self.progress[f"w{a}"] = p.model_copy(update={"step": p.step + 1, "ts": self.now})


@settings(max_examples=400, deadline=None)
@given(evs=events, window=st.sampled_from([0.0, 0.2]), startup=st.sampled_from([0.0, 0.5]))
def test_property_never_lent_while_generating_and_revoked_within_deadline(evs, window, startup):
    run_events(evs, window, startup)


def run_events(evs, window: float, startup: float) -> int:
    """Apply the events, then end the phase; asserts the invariants throughout; returns leases granted."""
    h = Harness(IdleDetector(util_threshold=10, window_s=window, startup_s=startup, stop_deadline_s=1.0))
    for ev in [("phase", "rollout", 0), *evs]:
        h.apply(ev)
    # end every run with the phase over and time passing: everything must come back
    h.apply(("phase", "train", 0))
    h.apply(("tick", 0.05, 0))
    assert not any(m.state == GpuState.LENT for m in h.d.machines.values())
    h.apply(("tick", 1.2, 0))
    assert not h.holders
    assert all(m.state not in (GpuState.LENT, GpuState.RECLAIMING) for m in h.d.machines.values())
    return h.token


def test_property_generator_exercises_lending():
    """Guard against a vacuous property test: the event generator does produce lends."""
    lends = []

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(evs=events)
    def run(evs):
        lends.append(run_events(evs, 0.0, 0.0))

    run()
    print(f"{sum(1 for n in lends if n > 0)} of {len(lends)} runs lent")
    assert sum(1 for n in lends if n > 0) >= 15


@settings(max_examples=100, deadline=None)
@given(finish=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=6))
def test_property_drained_workers_get_lent_during_a_long_tail(finish):
    """Liveness: with clean telemetry, every worker that drains while another still generates (and the
    tail is long enough) gets its GPU lent within window + one tick."""
    d = IdleDetector(util_threshold=10, window_s=0.2, startup_s=0.0, stop_deadline_s=1.0)
    ph = rollout(started=0.0)
    end = max(finish)
    lent_at: dict[int, float] = {}
    now = 0.0
    while now < end:
        now = round(now + 0.05, 6)
        p = {
            f"w{i}": prog(i, 0 if now >= f else 1, min(now, f) if now >= f else now)
            for i, f in enumerate(finish)
        }
        t = {(N, i): tel(i, 0.0 if now >= f else 90.0, now) for i, f in enumerate(finish)}
        for a in d.tick(now, ph, p, t):
            if a.kind == "lend":
                d.lent(N, a.gpu, len(lent_at) + 1, f"s{a.gpu}", now)
                lent_at[a.gpu] = now
    for i, f in enumerate(finish):
        if end - f > 0.2 + 0.05 + 1e-6:
            assert i in lent_at and lent_at[i] - f <= 0.2 + 0.05 + 1e-6


def test_lend_disabled_detects_but_never_lends():
    """Baseline runs (scheduler.lend=false) detect and count the tail's idle GPUs without lending them."""
    d = IdleDetector(util_threshold=10, window_s=0.2, startup_s=0.5, stop_deadline_s=1.0, lend=False)
    ph = rollout(started=0.0)
    p = {"w0": prog(0, 0, 2.0), "w1": prog(1, 2, 1.0)}
    t = {(N, 0): tel(0, 1.0, 2.05), (N, 1): tel(1, 90, 1.0)}
    d.tick(1.0, ph, p, t)
    kinds = [a.kind for now in (2.1, 2.25, 2.5, 3.0) for a in d.tick(now, ph, p, t)]
    assert kinds == ["idle"]  # detected once, never lent
    assert d.machines[(N, 0)].state == GpuState.DRAINED
