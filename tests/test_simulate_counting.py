"""`tailspec simulate`: the idle GPU-seconds the scheduler counts (the counting window of
tailspec/simulate/lending.py) against hand-computed cases and against the scheduler's own counter driven tick by
tick, and the window's inputs read from a recorded demo step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from tailspec.core.state import GpuState, GpuTelemetry, PhaseInfo, Progress
from tailspec.rollout.cost_model import CostModel
from tailspec.scheduler.idle import IdleDetector

from tailspec.simulate.calibrate import FLUSH_POLL_S, counting_window
from tailspec.simulate.lending import Latencies, decide
from tailspec.simulate.step import StepInputs, run_step, validations

LAT = Latencies(see_s=0.025, phase_s=0.035, lead_s=0.004, telemetry_s=0.1, window_s=0.2, tick_s=0.05,
                startup_s=0.3, stop_s=0.1, on_release=False)


def test_counting_window_hand_computed():
    """Two replicas done at 1.0 s and 2.0 s, the phase over at 2.0 s. Drain reports 4 ms before each result,
    read 25 ms later: at 1.021 and 2.021 s; the phase change read at 2.035 s. Counted: 1.014 + 0.014 (the last
    replica too). Replica 0 is lent when its idle window has passed: 1.0 - 0.004 + max(0.025, 0.1, 0.2) + 0.025
    = 1.221 s, revoked at 2.035 s, reclaimed 0.1 s later."""
    lend = decide(np.array([1.0, 2.0]), 2.0, 1, LAT, lend=True)
    assert lend.seen == pytest.approx([1.021, 2.021]) and lend.phase_seen == pytest.approx(2.035)
    assert lend.lent[0] == pytest.approx(1.221) and np.isnan(lend.lent[1])
    assert lend.revoked[0] == pytest.approx(2.035) and lend.reclaimed[0] == pytest.approx(2.135)
    # the same through a step: one request per replica, 0.01 s per token, nothing outside decode
    cost = CostModel([1], [0], {(1, 0): 0.01})
    inp = StepInputs(np.array([[100.0], [200.0]]), 1, [cost], None, np.zeros(2), 1.0, 1, LAT, lend=True,
                     drafter_tokens_per_s=0.0)
    out = run_step(inp)
    assert out.finish == pytest.approx([1.0, 2.0]) and out.phase_end == pytest.approx(2.0)
    assert out.idle_gpu_s == pytest.approx(1.014 + 0.014)
    assert out.lent_gpu_s == pytest.approx(2.035 - 1.221)
    assert out.wait_s == pytest.approx(0.135)
    assert sum(out.states.values()) == pytest.approx(2 * out.step_s)
    # the worker reports its memory released and the scheduler lends on that: no window, no telemetry wait,
    # lent at 1.0 - 0.004 + 0.025 + 0.025 = 1.046 s
    released = decide(np.array([1.0, 2.0]), 2.0, 1, replace(LAT, on_release=True), lend=True)
    assert released.lent[0] == pytest.approx(1.046) and released.reclaimed[0] == pytest.approx(2.135)


def test_a_drain_read_with_the_phase_change_is_not_counted():
    late = Latencies(see_s=0.05, phase_s=0.02, lead_s=0.0)
    lend = decide(np.array([1.0, 2.0]), 2.0, 1, late, lend=False)
    assert np.isnan(lend.seen[1]) and lend.seen[0] == pytest.approx(1.05)


def scheduler_count(drain_at: float, phase_at: float, tick_s: float, offset: float) -> float:
    """What scheduler/service.py `_lead` adds to `idle_gpu_seconds` for one GPU: each tick, its interval times
    the machines DRAINED or LENT when it began, the IdleDetector stepped on the snapshot the tick reads (the
    drain report is in Redis from `drain_at`, the train phase from `phase_at`)."""
    det = IdleDetector(window_s=0.2, startup_s=0.3, lend=False)
    rollout = PhaseInfo(phase="rollout", step=1, started_at=0.0)
    train = PhaseInfo(phase="train", step=1, started_at=phase_at)
    acc, last, now = 0.0, None, offset
    while now < phase_at + 3 * tick_s:
        drained = now >= drain_at
        p = {"w0": Progress(worker="w0", node="n", gpus=[0], active=0 if drained else 3, finished=0,
                            phase="rollout", step=1, ts=drain_at if drained else now)}
        t = {("n", 0): GpuTelemetry(node="n", gpu=0, util=0.0 if drained else 90.0, mem_used=0, mem_total=1,
                                    simulated=True, ts=now)}
        dt = 0.0 if last is None else now - last
        last = now
        acc += dt * det.count(GpuState.DRAINED, GpuState.LENT)
        det.tick(now, rollout if now < phase_at else train, p, t)
        now += tick_s
    return acc


@pytest.mark.parametrize("drain_at,phase_at", [(1.013, 1.021), (0.512, 1.3), (0.8, 0.84)])
def test_expected_count_over_the_tick_offset_is_the_projected_window(drain_at, phase_at):
    """The counter itself is whole ticks; over the tick grid's offset (uniform) its mean is the distance
    between the two writes, which is what the projection counts: both reads at tick / 2 after their write."""
    tick = 0.05
    counts = [scheduler_count(drain_at, phase_at, tick, u) for u in np.arange(200) * tick / 200]
    assert all(abs(c / tick - round(c / tick)) < 1e-6 for c in counts)  # whole ticks
    lat = Latencies(see_s=tick / 2, phase_s=tick / 2 + 0.0, lead_s=0.0, tick_s=tick)
    lend = decide(np.array([drain_at]), phase_at, 1, lat, lend=False)
    assert float(np.mean(counts)) == pytest.approx(lend.phase_seen - lend.seen[0], abs=1e-3)


def test_counting_window_from_a_recorded_step():
    """Recorded: the trainer's lag and each worker's drain lead. Not recorded (older runs): the lag is bounded
    by the step's time outside rollout and update less the two flush polls, the lead is 0."""
    row = {"step_time_s": 3.0, "rollout_time_s": 1.0, "train_time_s": 1.97}
    assert counting_window(row, 0.05) == pytest.approx((0.025 + 0.03 - 2 * FLUSH_POLL_S, 0.0))
    row |= {"phase_lag_s": 0.004, "worker_drain_lead_s": {"w0": 0.002, "w1": 0.004}}
    assert counting_window(row, 0.05) == pytest.approx((0.029, 0.003))
    short = {"step_time_s": 1.005, "rollout_time_s": 1.0, "train_time_s": 0.0}
    assert counting_window(short, 0.05) == pytest.approx((0.025, 0.0))


def test_validations_fit_the_longest_lent_interval():
    """One validation at a time cluster-wide, one per lent replica: the longest-lent replicas validate first,
    and all of them together never take more than the longest lent interval."""
    training = np.array([0.0, 5.0, 3.0, 4.0])
    assert validations(training, 2.0) == pytest.approx([0.0, 2.0, 1.0, 2.0])  # 5 s: 2 + 2 + 1
    assert validations(training, 10.0) == pytest.approx([0.0, 5.0, 0.0, 0.0])
    assert validations(np.zeros(3), 1.0) == pytest.approx([0.0, 0.0, 0.0])
    # through a step: the states still sum to GPUs x step time, and validating time trains nothing
    cost = CostModel([1], [0], {(1, 0): 0.01})
    base = StepInputs(np.array([[100.0], [300.0]]), 1, [cost], None, np.zeros(2), 1.0, 1, LAT, lend=True,
                      drafter_tokens_per_s=100.0)
    plain, val = run_step(base), run_step(replace(base, validation_s=0.5))
    assert val.states["lent_validating"] == pytest.approx(0.5)
    assert val.training_gpu_s == pytest.approx(plain.training_gpu_s - 0.5)
    assert val.drafter_tokens == pytest.approx(plain.drafter_tokens - 50.0)
    assert sum(val.states.values()) == pytest.approx(2 * val.step_s)
