"""The drafter health guard (rollout/health_guard.py): a broken drafter trips it within one window, a healthy
one with noisy acceptance does not, and speculation comes back only with another version."""

from __future__ import annotations

import numpy as np
import pytest
from tailspec.rollout.health_guard import GuardPolicy, HealthGuard, chain_alpha, guarded
from tailspec.rollout.strategy import StepRecord


def run_window(g: HealthGuard, rng, p_accept: float, k: int = 4, rows: int = 8, steps: int = 16):
    """Steps whose per-row acceptance is the run length of Bernoulli(p) draft acceptances (what speculative
    sampling produces for a drafter whose every draft is accepted with probability p)."""
    verdict = None
    for _ in range(steps):
        acc = 0
        for _ in range(rows):
            n = 0
            while n < k and rng.random() < p_accept:
                n += 1
            acc += n
        verdict = g.observe(k, rows, acc) or verdict
    return verdict


def test_a_broken_drafter_trips_within_one_window_and_speculation_stays_off_until_another_version():
    g = HealthGuard(GuardPolicy(window_steps=16))
    g.arm(version=3, validated=2.6, event="reload")
    rng = np.random.default_rng(0)
    v = run_window(g, rng, p_accept=0.0)
    assert v is not None and v.tripped and v.steps == 16 and v.version == 3 and v.event == "reload"
    assert "floor" in v.reason and "v3 broken after reload" in v.message()
    assert not g.speculate
    g.arm(version=3, validated=2.6, event="policy_sync")  # a sync does not repair the same drafter
    assert not g.speculate and not g.watching
    g.arm(version=4, validated=2.5, event="reload")  # a new version gets its chance
    assert g.speculate
    v = run_window(g, rng, p_accept=0.7)
    assert v is not None and not v.tripped and g.speculate


def test_far_below_the_validated_gain_trips_even_above_the_floor():
    g = HealthGuard(GuardPolicy(window_steps=8, floor=1.05, min_gain_share=0.5))
    g.arm(version=7, validated=3.0, event="policy_sync")  # validated gain 2.0
    v = run_window(g, np.random.default_rng(1), p_accept=0.3, steps=8)  # live gain ~0.4: above the floor
    assert v is not None and v.tripped and v.live > 1.05 and "validated gain" in v.reason


def test_noisy_healthy_drafters_never_trip_and_broken_ones_always_do():
    """200 windows each: a healthy drafter (p = 0.6, expected length ~2.3 at k = 4, validated at its own mean)
    never trips; a broken one (p = 0.02) always does."""
    rng = np.random.default_rng(2)
    expected = 1 + sum(0.6 ** j for j in range(1, 5))
    false_trips = missed = 0
    for trial in range(200):
        g = HealthGuard()
        g.arm(version=trial, validated=expected, event="load")
        false_trips += run_window(g, rng, 0.6).tripped
        g = HealthGuard()
        g.arm(version=trial, validated=expected, event="load")
        missed += not run_window(g, rng, 0.02).tripped
    assert false_trips == 0 and missed == 0


def test_plain_decoding_steps_are_not_evidence_and_an_unarmed_guard_does_nothing():
    g = HealthGuard(GuardPolicy(window_steps=2))
    assert g.observe(4, 8, 0) is None and g.speculate  # not armed
    g.arm(None, None, "load")
    assert g.observe(0, 8, 0) is None and g.observe(4, 0, 0) is None
    assert g.observe(4, 8, 16) is None
    v = g.observe(4, 8, 16)
    assert v is not None and not v.tripped and v.live == pytest.approx(3.0) and v.validated is None


def test_bad_counts_and_bad_policies_are_refused_by_name():
    g = HealthGuard()
    g.arm(1, 2.0, "load")
    with pytest.raises(ValueError, match="accepted"):
        g.observe(2, 4, 9)
    with pytest.raises(ValueError, match="window_steps"):
        GuardPolicy(window_steps=0)
    with pytest.raises(ValueError, match="floor"):
        GuardPolicy(floor=0.5)
    with pytest.raises(ValueError, match="min_gain_share"):
        GuardPolicy(min_gain_share=1.5)


def test_live_and_validated_compare_at_the_steps_own_draft_length():
    """Validated at k = 4 (length 3.0, α ≈ 0.72), run at k = 1 with the same α: live 1.72 is healthy, though
    its gain is well under half of the k = 4 gain 2.0 (comparing across k would trip a good drafter)."""
    rng = np.random.default_rng(3)
    alpha = chain_alpha(3.0, 4)
    assert sum(alpha**j for j in range(1, 5)) == pytest.approx(2.0)
    g = HealthGuard(GuardPolicy(window_steps=16))
    g.arm(version=5, validated=3.0, event="load", validated_k=4)
    v = run_window(g, rng, p_accept=alpha, k=1, rows=16)
    assert not v.tripped and v.validated == pytest.approx(1 + alpha)
    g.arm(version=6, validated=3.0, event="load", validated_k=4)
    v = run_window(g, rng, p_accept=0.25, k=1, rows=16)  # gain ~0.25 < half of 0.72
    assert v.tripped and "validated gain" in v.reason


def test_guarded_hook_feeds_the_guard_and_turns_speculation_off():
    g = HealthGuard(GuardPolicy(window_steps=2))
    g.arm(version=1, validated=2.5, event="load")
    verdicts = []
    hook = guarded(lambda b, last: 3, g, on_verdict=verdicts.append)
    rec = StepRecord.following(None, rows=4, strategy=3, accepted=0, reach=(0, 0, 0), seconds=0.01)
    assert hook(4, None) == 3 and hook(4, rec) == 3
    assert hook(4, rec) == 3  # the same record handed again counts once
    rec2 = StepRecord.following(rec, rows=4, strategy=3, accepted=0, reach=(0, 0, 0), seconds=0.01)
    assert hook(4, rec2) == 0 and len(verdicts) == 1 and verdicts[0].tripped
    assert hook(4, StepRecord.following(rec2, 4, 0, 0, (), 0.01)) == 0  # stays off
    g.arm(version=2, validated=2.5, event="reload")
    assert hook(4, None) == 3


def test_a_calls_totals_reach_the_verdict_its_steps_reach():
    """A framework's engines are read once per batch (`observe_totals`): the same drafts folded as one total
    give the step-by-step verdict's live and expected figures, and a total too small for a window waits."""
    rng = np.random.default_rng(3)
    steps = []
    for _ in range(16):
        rows = int(rng.integers(1, 9))
        steps.append((rows, int(sum(min(rng.geometric(0.45) - 1, 3) for _ in range(rows)))))
    by_step, by_total = HealthGuard(GuardPolicy(window_steps=16)), HealthGuard(GuardPolicy(window_steps=16))
    for g in (by_step, by_total):
        g.arm(version=2, validated=2.8, event="policy_sync")
    for rows, acc in steps:
        v_step = by_step.observe(3, rows, acc)
    assert by_total.observe_totals(3.0, 10, sum(a for _, a in steps[:2])) is None  # 10 drafts < a 16-step window
    v_total = by_total.observe_totals(3.0, sum(r for r, _ in steps) - 10, sum(a for _, a in steps[2:]))
    assert v_step is not None and v_total is not None and v_total.tripped == v_step.tripped
    assert v_total.live == pytest.approx(v_step.live) and v_total.validated == pytest.approx(v_step.validated)
    g = HealthGuard()
    g.arm(version=5, validated=3.0, event="wake")
    v = g.observe_totals(2.5, 400, 20)  # a mean draft length from mixed k: 1.05 tokens a forward
    assert v is not None and v.tripped and "floor" in v.reason
    g.arm(version=6, validated=3.0, event="reload")
    with pytest.raises(ValueError, match="accepted"):
        g.observe_totals(3.0, 10, 31)
