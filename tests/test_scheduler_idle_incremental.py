"""The incremental idle detector (scheduler/idle_index.py) against stepping every machine at every tick: over random
sequences of progress, telemetry, phase, lends, session ends, back-offs and learned memory needs, both make the same
decisions (actions, in order) and leave every machine in the same state, and every machine whose state or since
changed is among those the incremental one reports changed (the scheduler publishes only those).

A third detector sees telemetry as the scheduler reads it (scheduler/observe.py): the sample of every GPU that
`IdleDetector.sampled` names before the tick, and only a `Health` (there, and its error) for the others; it too
decides as the one that sees every sample. A fourth owns its machines and steps every one at every tick through
`IdleDetector.step_one`, the cluster projection's entry (tailspec/simulate/lending.py), with no index at all."""

from __future__ import annotations

import collections
from dataclasses import astuple

from hypothesis import given, settings
from hypothesis import strategies as st
from tailspec.core.state import GpuState, GpuTelemetry, PhaseInfo, Progress
from tailspec.scheduler.idle import GpuMachine, Health, IdleDetector

NODE = "n0"
WORKERS = {0: [0, 1], 1: [2], 2: [3]}  # worker → its GPUs; GPU 4 has telemetry and no worker
GPUS = [0, 1, 2, 3, 4]

_tick = st.tuples(st.just("tick"), st.sampled_from([0.05, 0.0, 0.01, 0.05, 0.2, 0.25, 0.6, 1.2]))
_report = st.tuples(st.just("progress"), st.sampled_from(sorted(WORKERS)), st.sampled_from([0, 0, 1, 3]),
                    st.sampled_from([None, 0.1, 2.0]), st.sampled_from([None, None, True, False]))
_sample = st.tuples(st.just("tel"), st.sampled_from(GPUS), st.sampled_from([0.5, 1.0, 5.0, 50.0, 90.0]))
# Every worker reports (some drained, some not) and every GPU is sampled accordingly: what makes lends likely.
_all = st.tuples(st.just("all_report"), st.tuples(*(st.sampled_from([0, 0, 2]) for _ in WORKERS)))
_event = st.one_of(
    _tick, _tick, _tick, _report, _report, _sample, _sample, _all, _all,
    st.tuples(st.just("same_progress"), st.sampled_from(sorted(WORKERS))),  # an equal report, a new object
    st.tuples(st.just("worker_gone"), st.sampled_from(sorted(WORKERS))),
    st.tuples(st.just("worker_steps"), st.sampled_from(sorted(WORKERS))),
    st.tuples(st.just("tel_error"), st.sampled_from(GPUS)),
    st.tuples(st.just("tel_mem"), st.sampled_from(GPUS), st.sampled_from([0, 1, 2])),
    st.tuples(st.just("tel_gone"), st.sampled_from(GPUS)),
    st.tuples(st.just("phase"), st.sampled_from(["rollout", "rollout", "train", "idle", None])),
    st.tuples(st.just("session_ends"), st.sampled_from(GPUS)),
    st.tuples(st.just("back_off"), st.sampled_from(GPUS), st.sampled_from([0.0, 0.3, 5.0])),
    st.tuples(st.just("need"), st.sampled_from([0, 1, 2])),
)

class StepOne:
    """Machines the caller owns, each stepped at every tick by `IdleDetector.step_one` (the rules, no index); created
    in the order a detector creates them (telemetry's GPUs, then the workers')."""

    def __init__(self, **params) -> None:
        self.det = IdleDetector(**params)
        self.machines: dict[tuple[str, int], GpuMachine] = {}

    def _machine(self, key: tuple[str, int]) -> GpuMachine:
        return self.machines.setdefault(key, GpuMachine(*key))

    def back_off(self, node: str, gpu: int, until: float) -> None:
        self._machine((node, gpu)).hold_until(until)

    def learn_need(self, nbytes: int) -> None:
        self.det.learn_need(nbytes)

    def lent(self, node: str, gpu: int, token: int, session_id: str, now: float) -> None:
        self._machine((node, gpu)).lend_to(token, session_id, now)

    def tick(self, now, phase, progress, telemetry, stopped) -> list:
        for k in [*telemetry, *((p.node, g) for p in progress.values() for g in p.gpus)]:
            self._machine(k)
        return [a for m in list(self.machines.values())
                for a in self.det.step_one(m, now, phase, progress, telemetry.get(m.key), stopped)]


class World:
    """The cluster state both detectors see, and the lends the scheduler would make."""

    def __init__(self, grant: list[bool]) -> None:
        self.now = 100.0
        self.step = 0
        self.phase: PhaseInfo | None = None
        self.progress: dict[str, Progress] = {}
        self.telemetry: dict[tuple[str, int], GpuTelemetry] = {}
        self.stopped: set[str] = set()
        self.grant = grant  # whether each lend in turn gets its lease
        self.lends = 0
        self.health: dict[tuple, Health] = {}  # one Health per GPU and error, as the observer keeps them

    def as_read(self, sampled: set[tuple[str, int]]) -> dict:
        """The telemetry as the scheduler reads it: samples of the `sampled` GPUs, a Health for every other."""
        out: dict = {}
        for k, t in self.telemetry.items():
            out[k] = t if k in sampled else self.health.setdefault((k, t.error), Health(t.error))
        return out

    def report(self, w: int, active: int, remaining: float | None, released: bool | None) -> None:
        self.now += 0.001
        phase = self.phase.phase if self.phase else "idle"
        self.progress[f"w{w}"] = Progress(worker=f"w{w}", node=NODE, gpus=WORKERS[w], active=active, finished=0,
                                          phase=phase, step=self.step, remaining_s=remaining, mem_released=released,
                                          ts=self.now)

    def sample(self, g: int, util: float, error: str | None = None, free_gib: int = 2) -> None:
        self.now += 0.001
        self.telemetry[(NODE, g)] = GpuTelemetry(node=NODE, gpu=g, util=util, mem_used=(2 - free_gib) << 30,
                                                 mem_total=2 << 30, simulated=True, error=error, ts=self.now)


def _apply(w: World, dets: list[IdleDetector], ev: tuple) -> None:
    kind = ev[0]
    if kind == "progress":
        w.report(ev[1], ev[2], ev[3], ev[4])
    elif kind == "all_report":
        for wk, active in zip(sorted(WORKERS), ev[1]):
            w.report(wk, active, None, None)
        w.now += 0.01
        for wk, active in zip(sorted(WORKERS), ev[1]):
            for g in WORKERS[wk]:
                w.sample(g, 80.0 if active else 1.0)
    elif kind == "same_progress" and f"w{ev[1]}" in w.progress:
        p = w.progress[f"w{ev[1]}"]
        w.progress[p.worker] = p.model_copy()
    elif kind == "worker_gone":
        w.progress.pop(f"w{ev[1]}", None)
    elif kind == "worker_steps" and f"w{ev[1]}" in w.progress:
        p = w.progress[f"w{ev[1]}"]
        w.progress[p.worker] = p.model_copy(update={"step": p.step + 1})
    elif kind == "tel":
        w.sample(ev[1], ev[2])
    elif kind == "tel_error":
        w.sample(ev[1], 0.0, error="NVML: GPU is lost")
    elif kind == "tel_mem":
        w.sample(ev[1], 0.5, free_gib=ev[2])
    elif kind == "tel_gone":
        w.telemetry.pop((NODE, ev[1]), None)
    elif kind == "phase":
        if ev[1] == "rollout":
            w.step += 1
        w.phase = None if ev[1] is None else PhaseInfo(phase=ev[1], step=w.step, started_at=w.now)
    elif kind == "session_ends":
        m = dets[0].machines.get((NODE, ev[1]))
        if m is not None and m.session_id is not None:
            w.stopped.add(m.session_id)
    elif kind == "back_off":
        for d in dets:
            d.back_off(NODE, ev[1], w.now + ev[2])
    elif kind == "need":
        for d in dets:
            d.learn_need(ev[1] << 30)
    elif kind == "tick":
        w.now += ev[1]
        _tick(w, dets)


def _tick(w: World, dets: list[IdleDetector]) -> None:
    full, inc, read, one = dets
    before = {k: (m.state, m.since) for k, m in full.machines.items()}
    a_full = full.tick(w.now, w.phase, dict(w.progress), dict(w.telemetry), set(w.stopped))
    a_inc = inc.tick(w.now, w.phase, dict(w.progress), dict(w.telemetry), set(w.stopped))
    assert a_inc == a_full
    sampled = read.sampled(w.phase, dict(w.progress), set(w.stopped))
    drained = {(p.node, g) for p in w.progress.values() if p.active == 0 and p.phase == "rollout" for g in p.gpus}
    lent = {k for k, m in read.machines.items() if m.state == GpuState.LENT and m.session_id not in w.stopped}
    assert sampled == (drained - lent if w.phase is not None and w.phase.phase == "rollout" else set())
    assert read.tick(w.now, w.phase, dict(w.progress), w.as_read(sampled), set(w.stopped)) == a_full
    assert one.tick(w.now, w.phase, dict(w.progress), dict(w.telemetry), set(w.stopped)) == a_full
    for a in a_full:
        if a.kind == "lend":
            w.lends += 1
            if w.grant[w.lends % len(w.grant)]:
                for d in dets:
                    d.lent(a.node, a.gpu, w.lends, f"s{w.lends}", w.now)
        elif a.kind == "reclaimed":
            w.stopped.discard(a.session_id)
    assert {k: astuple(m) for k, m in one.machines.items()} == {k: astuple(m) for k, m in full.machines.items()}
    for d in (inc, read):
        assert {k: astuple(m) for k, m in d.machines.items()} == {k: astuple(m) for k, m in full.machines.items()}
        changed = set(d.changed())
        for k, m in full.machines.items():
            if before.get(k) != (m.state, m.since):
                assert k in changed, f"{k} went {before.get(k)} -> {(m.state, m.since)} but is not reported changed"
        for st_ in {m.state for m in full.machines.values()}:
            assert d.count(st_) == sum(m.state == st_ for m in full.machines.values())


@settings(max_examples=600, deadline=None)
@given(evs=st.lists(_event, min_size=1, max_size=120), window=st.sampled_from([0.0, 0.2]),
       startup=st.sampled_from([0.0, 0.5]), release=st.booleans(),
       grant=st.lists(st.booleans(), min_size=1, max_size=4))
def test_incremental_detector_decides_as_stepping_every_machine(evs, window, startup, release, grant):
    params = {"util_threshold": 10, "window_s": window, "startup_s": startup, "stop_deadline_s": 1.0,
              "require_release": release, "min_free_bytes": 1 << 30}
    dets = [IdleDetector(**params, incremental=False), IdleDetector(**params), IdleDetector(**params),
            StepOne(**params)]
    w = World(grant)
    for ev in [("phase", "rollout"), *evs, ("phase", "train"), ("tick", 0.05), ("tick", 1.2)]:
        _apply(w, dets, ev)


def test_generator_reaches_every_state():
    """Guard against a vacuous comparison: the sequences lend, revoke and reclaim."""
    kinds: collections.Counter[str] = collections.Counter()

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(evs=st.lists(_event, min_size=20, max_size=120))
    def run(evs):
        dets = [IdleDetector(window_s=0.0, startup_s=0.0, incremental=False),
                *(IdleDetector(window_s=0.0, startup_s=0.0) for _ in range(2)), StepOne(window_s=0.0, startup_s=0.0)]
        w = World([True])
        orig = dets[0].tick

        def tick(*a, **kw):
            acts = orig(*a, **kw)
            kinds.update(x.kind for x in acts)
            return acts

        dets[0].tick = tick  # type: ignore[method-assign]
        for ev in [("phase", "rollout"), *evs, ("phase", "train"), ("tick", 0.05), ("tick", 1.2)]:
            _apply(w, dets, ev)

    run()
    print(dict(kinds))
    assert all(kinds[k] >= 10 for k in ("idle", "lend", "revoke", "reclaimed")), dict(kinds)
