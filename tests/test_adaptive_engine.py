"""Lossless with the adaptive selector in the loop: it switches k mid-sequence (exploration forced high) and
greedy output still equals HF generate, and speculative sampling still follows the target's distribution.
Also: the cost model's warm-up on a real engine, and the selector learning from the engine's own step records."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import hf_greedy, micro_policy, random_micro, task_prompts
from tailspec.rollout import cost_model
from tailspec.rollout.acceptance import AcceptanceTracker
from tailspec.rollout.drafters import DraftModelProposer, NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.selector import AdaptiveSelector
from tailspec.rollout.sequence import SamplingParams

MAX_TOKENS = [6, 90, 12, 120, 40, 90, 3, 120]


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(2)
    model, _ = micro_policy()
    return model


@pytest.fixture(scope="module")
def reference(policy):
    prompts = task_prompts(len(MAX_TOKENS))
    return prompts, [hf_greedy(policy, p, m) for p, m in zip(prompts, MAX_TOKENS)]


def mid_sequence_switches(history) -> int:
    """Consecutive steps at the same batch size (no request joined or left) that ran different k."""
    return sum(a.rows == b.rows and a.k != b.k for a, b in itertools.pairwise(history))


def test_cost_model_warmup_on_the_real_engine(policy):
    eng = Engine(policy, NgramProposer(), max_batch=8, max_seq_len=256, k_max=3)
    acc = AcceptanceTracker(k_max=3)
    cost = cost_model.measure(eng, task_prompts(8), buckets=[1, 4, 8], ks=[0, 1, 3], steps=3,
                              block=1, settle=1, rows=8, on_step=acc.observe)
    # every timed step with k > 0: 2 strategies x (8 steps at bucket 1, enough for 8 rows; 3 at buckets 4, 8)
    assert acc.updates == 2 * (8 + 3 + 3)
    assert set(cost.table) == {(b, k) for b in (1, 4, 8) for k in (0, 1, 3)}
    assert all(0 < t < 5 for t in cost.table.values())
    assert not eng.has_unfinished() and eng.selector(1, eng.last) == 0  # left idle, hook restored
    # the strategies took turns on one batch per bucket (not one batch per strategy, run one after another)
    ks_at_8 = [r.k for r in eng.history if r.rows == 8]
    assert sum(a != b for a, b in itertools.pairwise(ks_at_8)) >= 4
    eng.add_request(task_prompts(1)[0], SamplingParams(max_tokens=8))
    eng.step()
    assert eng.abort_all() == 1 and not eng.has_unfinished()
    with pytest.raises(ValueError, match="max_batch"):
        cost_model.measure(eng, task_prompts(2), buckets=[16], ks=[0])


def test_records_count_the_run_of_each_k(policy):
    """StepRecord.run = consecutive steps at its k, itself included: what the acceptance tracker uses to leave
    a new strategy's settling steps out of its own mean. The hook is handed the record of the step just run."""
    pattern = [2, 2, 2, 1, 3, 3, 0, 0, 2]
    seen = []

    def choose(batch_size, last):
        if last is not None:
            seen.append((last.k, last.run))
        return pattern[(last.step if last is not None else 0) % len(pattern)]

    eng = Engine(policy, NgramProposer(), selector=choose, max_batch=2, max_seq_len=256, k_max=3)
    eng.generate(task_prompts(2), SamplingParams(max_tokens=60, temperature=0.0))
    seen.append((eng.last.k, eng.last.run))
    ks = [r.k for r in eng.history]
    want = [(k, 1 + next((i for i in range(j) if ks[j - 1 - i] != k), j)) for j, k in enumerate(ks)]
    assert seen == want and max(r for _, r in want) >= 3


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_adaptive_switching_k_greedy_matches_hf(policy, reference, drafter):
    prompts, refs = reference
    d = NgramProposer() if drafter == "ngram" else DraftModelProposer(random_micro(seed=3))
    eng = Engine(policy, d, max_batch=5, max_seq_len=256, k_max=4)
    # Equal costs keep every k a candidate whatever the machine's load (a measured table made this test
    # depend on timing: under load k > 0 dropped out and nothing switched); measuring has its own test above.
    cost = cost_model.CostModel([1, 2, 4, 5], [0, 1, 2, 4], {(b, k): 1e-3 for b in (1, 2, 4, 5) for k in (0, 1, 2, 4)})
    # one-step explorations: as many switches as the selector can make (its default runs are 5 steps)
    sel = AdaptiveSelector(cost, AcceptanceTracker(k_max=4), epsilon=0.5, hysteresis=0.0, explore_run=1, seed=3)
    eng.configure(selector=sel)
    outs = eng.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS])
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r, f"prompt {i}: engine {o.token_ids} != HF {r}"
    assert mid_sequence_switches(eng.history) >= 5, list(eng.history)[:20]
    assert sel.acceptance.updates > 0 and sel.cost.observed > 0  # it learned from the engine's own records


def test_adaptive_switching_k_sampling_is_exact():
    """The engine sampling test's independent reference (exact enumeration of the target's first three
    tokens through HF's warpers) with the adaptive selector choosing k at every step."""
    from test_engine_sampling import PROMPT, SETTINGS, N, check, enumerate_joint, small_llama

    torch.set_num_threads(2)
    target, poor = small_llama(0), small_llama(1)
    setting = SETTINGS["t0.7-p0.9"]
    eng = Engine(target, DraftModelProposer(poor), max_batch=N, max_seq_len=len(PROMPT) + 3, k_max=2)
    cost = cost_model.CostModel([1], [0, 1, 2], {(1, 0): 1.0, (1, 1): 1.0, (1, 2): 1.0})
    sel = AdaptiveSelector(cost, AcceptanceTracker(k_max=2), epsilon=0.5, learn_cost=False, explore_run=1, seed=4)
    ks = []

    def choose(n, last):
        ks.append(sel(n, last))
        return ks[-1]

    eng.configure(selector=choose)
    outs = eng.generate([PROMPT] * N, [SamplingParams(max_tokens=3, seed=i, ignore_eos=True, **setting) for i in range(N)])
    import numpy as np

    toks = np.array([o.token_ids for o in outs])
    assert len(set(ks)) >= 2 and max(ks) > 0, ks  # k changed between the steps of the same sequences
    ok, pval, tv, bound = check(toks, enumerate_joint(target, **setting))
    assert ok, f"k sequence {ks}: chi-square p={pval:.2e}, TV={tv:.4f} (bound {bound:.4f})"
