"""Grouped-query attention folded into the query length (rollout.model_runner.gqa_attention): on CUDA the
engine's forwards fold a group's query heads into one head over more query tokens, so the memory-efficient kernel
(which needs equal head counts) serves GQA models without copying keys and values, instead of the math kernel
that `enable_gqa` falls back to once cuDNN's is excluded. Checked here on CPU with the fold turned on for it:
against an independent reference (keys/values repeated per query head, masked softmax) and, through the engine
with an EAGLE-3 drafter, against the unfolded path (`enable_gqa`, the CPU's)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_eagle3, random_micro, task_prompts
from tailspec.rollout import model_runner
from tailspec.rollout.drafters import Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.model_runner import attention_mask, gqa_attention
from tailspec.rollout.sequence import SamplingParams


def reference(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("fold", [True, False])
def test_attention_matches_repeated_heads(monkeypatch, groups, T, fold):
    monkeypatch.setattr(model_runner, "FOLD_GQA_DEVICES", ("cuda", "cpu") if fold else ())
    torch.manual_seed(groups * 10 + T)
    B, Hk, L, D = 3, 2, 64, 16
    q = torch.randn(B, Hk * groups, T, D)
    k, v = torch.randn(B, Hk, L, D), torch.randn(B, Hk, L, D)
    pos = torch.tensor([5, 40, 63 - T + 1])[:, None] + torch.arange(T)  # ragged positions per row
    mask = (torch.arange(L)[None, None, :] <= pos[:, :, None])[:, None]
    added = attention_mask(mask, groups, q.dtype)
    assert added.shape == (B, 1, (groups if fold else 1) * T, L)
    out = gqa_attention(q, k, v, added)
    assert out.shape == (B, Hk * groups, T, D)
    torch.testing.assert_close(out, reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_the_mask_is_additive_in_the_model_dtype():
    allowed = torch.tensor([[True, True, False]])[:, None, None]
    m = attention_mask(allowed, 1, torch.bfloat16)
    assert m.dtype == torch.bfloat16 and m.tolist() == [[[[0.0, 0.0, float("-inf")]]]]


@pytest.mark.parametrize("rule", ["coupled", "residual"])
def test_engine_with_eagle3_decodes_the_same_folded(monkeypatch, rule):
    """The target's forward and the EAGLE-3 drafter's both fold (micro: 2 query heads over 1 key/value head)."""
    policy = random_micro()
    assert policy.config.num_attention_heads > policy.config.num_key_value_heads
    prompts = task_prompts(6, seed=2)
    sp = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(len(prompts))]

    def run():
        eng = Engine(policy, Eagle3Proposer(random_eagle3(policy), target=policy), selector=3, max_batch=4,
                     max_seq_len=256, verify_rule=rule)
        return eng.generate(prompts, sp)

    monkeypatch.setattr(model_runner, "FOLD_GQA_DEVICES", ())
    plain = run()
    monkeypatch.setattr(model_runner, "FOLD_GQA_DEVICES", ("cuda", "cpu"))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((q.shape[1], k.shape[1])) or sdpa(q, k, v, **kw))
    folded = run()
    assert calls and all(hq == hk for hq, hk in calls)  # every attention saw equal head counts
    for a, b in zip(plain, folded):
        assert a.token_ids == b.token_ids
        assert (a.stats.drafted, a.stats.accepted) == (b.stats.drafted, b.stats.accepted)
        assert (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item() <= 1e-5


def test_folded_output_with_the_kernels_own_strides(monkeypatch):
    """On an H100 the memory-efficient kernel returned its output with [B,T,H,D] strides, which `view` refused (the
    engine failed on the GPU while every CPU test passed). SDPA here returns the same values in that layout."""
    monkeypatch.setattr(model_runner, "FOLD_GQA_DEVICES", ("cuda", "cpu"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: sdpa(q, k, v, **kw).transpose(1, 2).contiguous().transpose(1, 2))
    torch.manual_seed(0)
    B, Hk, groups, T, L, D = 2, 2, 2, 3, 16, 8
    q, k, v = torch.randn(B, Hk * groups, T, D), torch.randn(B, Hk, L, D), torch.randn(B, Hk, L, D)
    mask = torch.ones(B, 1, T, L, dtype=torch.bool).tril(L - T)
    out = gqa_attention(q, k, v, attention_mask(mask, groups, q.dtype))
    torch.testing.assert_close(out, reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
