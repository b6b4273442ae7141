"""The policy's entropy and its move between steps (tailspec/rl.py: policy_drift), against exact values: the
entropy of the full next-token distribution, and KL(earlier || now) summed over the vocabulary at one position,
which the k3 estimate on the earlier policy's own samples must match within its sampling error."""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tailspec.rl import Rollout, policy_drift

V, PROMPT, T = 12, [1, 5, 3], 1.3


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).eval()


def next_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float() / T, -1)


def test_entropy_is_the_full_distributions_over_response_positions():
    m = tiny(0)
    ro = [Rollout(PROMPT, [4, 7], [0.0, 0.0], 0.0, 0), Rollout(PROMPT[:2], [2], [0.0], 0.0, 0)]
    want = []
    for r in ro:
        seq = r.prompt_ids + r.response_ids
        for j in range(len(r.response_ids)):
            want.append(float(torch.distributions.Categorical(logits=next_logprobs(m, seq[: len(r.prompt_ids) + j])).entropy()))
    ent, kl = policy_drift(m, ro, None, pad_id=0, temperature=T)
    assert kl is None
    assert abs(ent - sum(want) / len(want)) < 1e-5


def test_kl_is_zero_for_an_unmoved_policy_and_matches_the_exact_kl_after_a_move():
    before, after = tiny(0), tiny(0)
    with torch.no_grad():
        for p in after.parameters():
            p.add_(0.3 * torch.randn_like(p))
    lp = next_logprobs(before, PROMPT)
    g = torch.Generator().manual_seed(1)
    toks = torch.multinomial(lp.exp(), 6000, replacement=True, generator=g).tolist()
    prev = [Rollout(PROMPT, [t], [float(lp[t])], 0.0, 0) for t in toks]
    _, kl0 = policy_drift(before, prev[:50], prev, pad_id=0, temperature=T)
    assert kl0 is not None and abs(kl0) < 1e-6
    _, kl = policy_drift(after, prev[:50], prev, pad_id=0, temperature=T)
    lq = next_logprobs(after, PROMPT)
    exact = float((lp.exp() * (lp - lq)).sum())
    log_r = torch.tensor([float(lq[t] - lp[t]) for t in toks])
    se = float((log_r.exp() - 1 - log_r).std()) / math.sqrt(len(toks))
    assert exact > 0.01  # the move is large enough for the check to mean something
    assert abs(kl - exact) < 4 * se + 1e-6, (kl, exact, se)
    # a wrong sign (the mean log-ratio now / then, i.e. minus the KL) is off by far more than the sampling error
    assert abs(float(log_r.mean()) - exact) > 4 * se
