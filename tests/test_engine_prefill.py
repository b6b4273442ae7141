"""The prefill plan (rollout/prefill.py): every admitted row is covered once, each distinct prompt is prefilled
once and its repeats copy it, chunks pad within their bound; and a batch of repeated prompts of mixed lengths
decodes the same tokens and logprobs as each request decoded alone."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import hf_greedy, micro_policy, random_eagle3, task_prompts
from tailspec.rollout import prefill
from tailspec.rollout.drafters import DraftModelProposer, Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams


def test_plan_covers_every_row_once_and_copies_only_equal_prompts():
    rng = random.Random(0)
    for trial in range(200):
        distinct = [[rng.randrange(3, 30) for _ in range(rng.choice([1, 2, 5, 9, 17, 40, 140]))]
                    for _ in range(rng.randrange(1, 9))]
        prompts = [rng.choice(distinct) for _ in range(rng.randrange(1, 33))]
        ratio = rng.choice([1.0, 1.5, 2.0, 4.0])
        order, chunks = prefill.plan(prompts, max_ratio=ratio)
        assert sorted(order) == list(range(len(prompts)))
        assert chunks[0].start == 0 and chunks[-1].end == len(prompts)
        rows = [prompts[i] for i in order]
        for c, nxt in zip(chunks, chunks[1:] + [None]):
            assert nxt is None or nxt.start == c.end
            uniq = rows[c.start : c.start + c.unique]
            assert len({tuple(p) for p in uniq}) == c.unique  # each prefilled once
            assert c.width == max(len(p) for p in uniq)
            assert c.width <= ratio * max(1, min(len(p) for p in uniq))  # padding within the bound
            assert len(c.sources) == c.end - c.start - c.unique
            for j, src in enumerate(c.sources):
                assert c.start <= src < c.start + c.unique
                assert rows[c.start + c.unique + j] == rows[src]
        # a distinct prompt is prefilled in exactly one chunk
        assert sum(c.unique for c in chunks) == len({tuple(p) for p in prompts})


def test_plan_rejects_a_ratio_below_one():
    with pytest.raises(ValueError, match="max_ratio"):
        prefill.plan([[1, 2]], max_ratio=0.5)


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(2)
    return micro_policy()[0]


def group_batch(n_prompts: int = 5, group: int = 3, seed: int = 7) -> list[list[int]]:
    """A GRPO-like batch: each prompt `group` times, prompts of mixed lengths (a long one among short ones)."""
    base = task_prompts(n_prompts, seed=seed)
    base[0] = base[0] + base[1] + base[2]  # a long prompt: the padded prefill would pad every row to it
    return [p for p in base for _ in range(group)]


@pytest.mark.parametrize("rule", ["coupled", "residual"])
@pytest.mark.parametrize("drafter_kind", ["none", "draft_model", "eagle3"])
def test_repeated_prompts_decode_as_each_alone(policy, drafter_kind, rule):
    """Tokens, logprobs and the drafts accepted (which follow the drafter's state after prefill) are the same
    as each request's alone, under both verify rules (under the residual rule the tokens follow the drafts)."""
    prompts = group_batch()
    sp = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i) for i in range(len(prompts))]

    def engine(max_batch):
        drafter = {"none": None, "draft_model": DraftModelProposer(policy),
                   "eagle3": Eagle3Proposer(random_eagle3(policy), target=policy)}[drafter_kind]
        return Engine(policy, drafter, selector=0 if drafter is None else 2, max_batch=max_batch, max_seq_len=256,
                      verify_rule=rule)

    together = engine(len(prompts)).generate(prompts, sp)
    alone = [engine(1).generate([p], [s])[0] for p, s in zip(prompts, sp)]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
        assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
        assert diff <= 1e-4, diff
    # copies of one prompt with other seeds are other samples: the copy carries the cache, not the randomness
    assert len({tuple(o.token_ids) for o in together[:3]}) > 1


def test_greedy_repeated_prompts_match_hf(policy):
    prompts = group_batch(n_prompts=4, group=2, seed=3)
    outs = Engine(policy, None, max_batch=len(prompts), max_seq_len=256).generate(
        prompts, SamplingParams(max_tokens=20, temperature=0.0))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(policy, p, 20, eos=policy.config.eos_token_id)


def test_a_cache_allocated_with_garbage_decodes_as_a_zeroed_one(policy):
    """On a CPU the KV cache is not zeroed at allocation but as attention first reaches its positions: a cache
    whose memory holds NaN (what torch.empty may return) decodes exactly what a fresh one does, through prefill,
    decoding past several attention buckets and compaction (rows finishing at different lengths)."""
    prompts = group_batch(n_prompts=4, group=2, seed=5)
    sp = [SamplingParams(max_tokens=90 + 10 * i, temperature=1.0, seed=i) for i in range(len(prompts))]

    def run(poison: bool):
        eng = Engine(policy, DraftModelProposer(policy), selector=2, max_batch=4, max_seq_len=256)
        if poison:
            eng.runner._kv_all.fill_(float("nan"))  # noqa: SLF001 - the invariant under test is about this buffer
        return eng.generate(prompts, sp)

    clean, poisoned = run(False), run(True)
    assert max(len(o.token_ids) for o in clean) > 64  # past the first attention bucket
    for a, b in zip(clean, poisoned):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
