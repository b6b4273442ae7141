"""Greedy decoding through the engine is token-identical to HF `generate(do_sample=False)`, EOS and
max_tokens stops included, for every drafter, k in {1, 3, 7} and batch sizes 1, 5, 16."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import hf_greedy, micro_policy, noisy_copy, random_eagle3, task_prompts
from tailspec.rollout.drafters import DraftModelProposer, Eagle3Proposer, NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams

N_PROMPTS = 16
MAX_TOKENS = [6, 30, 12, 36, 25, 30, 3, 36, 28, 30, 20, 36, 30, 26, 36, 30]


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(2)
    model, _ = micro_policy()
    return model


def pick_stop(response: list[int], lo: int = 8) -> int | None:
    """A token whose first occurrence in the response is at index >= lo (so decoding runs a while first)."""
    seen = set(response[:lo])
    return next((t for t in response[lo:] if t not in seen), None)


@pytest.fixture(scope="module")
def reference(policy):
    """HF references; every other prompt gets an extra EOS id (HF `eos_token_id=[2, t]`, the engine's
    stop_token_ids=(t,)) chosen from its own greedy response, so EOS stops are exercised even by a policy
    that rarely ends on its own."""
    prompts = task_prompts(N_PROMPTS)
    assert len({len(p) for p in prompts}) >= 6, "prompts of different lengths"
    stops: list[tuple[int, ...]] = []
    refs = []
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS)):
        r = hf_greedy(policy, p, m)
        t = pick_stop(r) if i % 2 else None
        if t is not None:  # = HF with eos_token_id=[2, t]: greedy decoding is the same up to the stop
            r = r[: r.index(t) + 1]
        stops.append((t,) if t is not None else ())
        refs.append(r)
    eos_stops = sum(r[-1] in (2, *s) for r, s in zip(refs, stops))
    length_stops = sum(len(r) == m and r[-1] not in (2, *s) for r, s, m in zip(refs, stops, MAX_TOKENS))
    assert eos_stops >= 4 and length_stops >= 4, "the reference must exercise both EOS and max_tokens stops"
    return prompts, refs, stops


def make_drafter(name: str, policy):
    if name == "ngram":
        return NgramProposer()
    if name == "draft_model":
        return DraftModelProposer(noisy_copy(policy))  # a fair drafter: accepts and rejections both common
    if name == "draft_model_self":
        return DraftModelProposer(policy)  # a perfect one: every draft accepted
    if name == "eagle3":
        return Eagle3Proposer(random_eagle3(policy))
    raise AssertionError(name)


def run(policy, drafter, selector, batch, reference):
    prompts, _, stops = reference
    eng = Engine(policy, drafter, selector=selector, max_batch=batch, max_seq_len=256)
    params = [SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=s) for m, s in zip(MAX_TOKENS, stops)]
    return eng.generate(prompts, params)


def assert_identical(outs, reference):
    _, refs, stops = reference
    for i, (o, r, s) in enumerate(zip(outs, refs, stops)):
        assert o.token_ids == r, f"prompt {i}: engine {o.token_ids} != HF {r}"
        assert o.finish_reason == ("stop" if r[-1] in (2, *s) else "length")
        assert len(o.logprobs) == len(r)


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_plain_decoding_matches_hf(policy, reference, batch):
    assert_identical(run(policy, None, 0, batch, reference), reference)


@pytest.mark.parametrize(
    "drafter,k,batch",
    list(itertools.product(["ngram", "draft_model", "eagle3"], [1, 3, 7], [1, 5, 16]))
    + [("draft_model_self", 3, 5)],
)
def test_speculative_greedy_matches_hf(policy, reference, drafter, k, batch):
    outs = run(policy, make_drafter(drafter, policy), k, batch, reference)
    assert_identical(outs, reference)
    drafted = sum(o.stats.drafted for o in outs)
    accepted = sum(o.stats.accepted for o in outs)
    assert drafted > 0 and 0 <= accepted <= drafted
    if drafter == "draft_model_self":  # the target drafting for itself: everything it proposes is accepted
        assert all(o.stats.acceptance_length > 1.5 for o in outs if len(o.token_ids) > 8)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle3", "draft_model_self"])
def test_k_may_change_every_step(policy, reference, drafter):
    """The selector is asked every step; a k that jumps around (0 included) changes nothing."""
    ks = itertools.cycle([0, 3, 1, 7, 0, 0, 2, 5])
    asked = []

    def selector(batch_size, last):
        asked.append(batch_size)
        return next(ks)

    outs = run(policy, make_drafter(drafter, policy), selector, 5, reference)
    assert_identical(outs, reference)
    assert max(asked) == 5 and min(asked) < 5  # the batch shrinks through the tail
