"""TTT loss against a direct per-token computation, acceptance length against its definition, reward weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tailspec.drafter_trainer.loss import acceptance_rates, expected_length, ttt_loss
from tailspec.drafter_trainer.model import DrafterCache, capture_aux, vocab_maps_from_counts
from tailspec.drafter_trainer.weights import reward_weights

from tests.test_trainer_model import make_drafter, make_target

torch.set_num_threads(1)


def _setup(draft_vocab=16):
    target = make_target()
    d = make_drafter(target, draft_vocab)
    if draft_vocab:
        d.set_vocab_maps(*vocab_maps_from_counts(torch.arange(21.0) % 7, draft_vocab))
    torch.manual_seed(11)
    lengths = torch.tensor([12, 9])
    prompt_lens = torch.tensor([4, 3])
    ids = torch.randint(0, 21, (2, 12))
    ids[1, 9:] = 0  # right padding
    with capture_aux(target, d.config.aux_layer_ids) as got, torch.no_grad():
        logits = target(ids).logits
    return target, d, ids, lengths, prompt_lens, got[0], logits


def _drafts_by_inference(d, g, ids, b, anchor, steps):
    """Inference-style drafting for one row and anchor (model.py's procedure): list of logits per step."""
    cache = DrafterCache.allocate(d.config, 1, 64)
    slot = torch.tensor([0])
    pos = torch.arange(anchor + 1)[None]
    logits, out = d(d.project(g[b : b + 1, : anchor + 1]), ids[b : b + 1, 1 : anchor + 2], pos, cache, slot)
    res, hid = [logits[0, -1]], out[:, -1:]
    for i in range(1, steps):
        logits, hid = d(hid, ids[b : b + 1, anchor + 1 + i : anchor + 2 + i], torch.tensor([[anchor + i]]), cache, slot)
        res.append(logits[0, 0])
    return res


@pytest.mark.parametrize("draft_vocab", [None, 16])
def test_ttt_loss_equals_direct_computation(draft_vocab):
    target, d, ids, lengths, prompt_lens, g, tlogits = _setup(draft_vocab)
    weights = torch.tensor([1.5, 0.5])
    steps, decay = 3, 0.8
    out = ttt_loss(d, g, tlogits, ids, lengths, prompt_lens, weights, steps, decay)
    keep = (torch.arange(d.config.draft_vocab_size) + d.d2t).tolist()
    num = [0.0] * steps
    cnt = [0] * steps
    with torch.no_grad():
        for b in range(2):
            n, p_len = int(lengths[b]), int(prompt_lens[b])
            for anchor in range(p_len - 1, n):
                chain = [i for i in range(steps) if anchor + 2 + i <= n - 1]
                if not chain:
                    continue
                drafts = _drafts_by_inference(d, g, ids, b, anchor, len(chain))
                for i in chain:
                    p = torch.softmax(tlogits[b, anchor + 1 + i, keep], -1)
                    ce = -(p * torch.log_softmax(drafts[i], -1)).sum()
                    num[i] += float(weights[b]) * float(ce)
                    cnt[i] += 1
    direct = sum(decay ** i * num[i] / max(cnt[i], 1) for i in range(steps))
    assert out.loss.item() == pytest.approx(direct, rel=1e-5)
    assert out.tokens == cnt[0]
    # The loss is differentiable w.r.t. the drafter only.
    out.loss.backward()
    assert d.fc.weight.grad is not None and target.model.embed_tokens.weight.grad is None


def test_expected_acceptance_matches_definition():
    target, d, ids, lengths, prompt_lens, g, tlogits = _setup(16)
    k = 3
    alpha, valid = acceptance_rates(d, g, tlogits, ids, lengths, prompt_lens, k)
    keep = torch.arange(16) + d.d2t
    with torch.no_grad():
        b, anchor = 0, 5
        assert bool(valid[b, anchor])
        drafts = _drafts_by_inference(d, g, ids, b, anchor, k)
        for i in range(k):
            q = torch.zeros(21)
            q[keep] = torch.softmax(drafts[i], -1)
            p = torch.softmax(tlogits[b, anchor + 1 + i], -1)
            assert alpha[b, anchor, i].item() == pytest.approx(torch.minimum(p, q).sum().item(), abs=1e-6)
    # Valid anchors: response anchors whose k predictions stay inside the sequence.
    assert valid[0].nonzero().flatten().tolist() == list(range(3, 12 - k - 1))
    assert valid[1].nonzero().flatten().tolist() == list(range(2, 9 - k - 1))
    e = expected_length(torch.tensor([[0.5, 0.5, 0.5]]))
    assert e.item() == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_length(torch.ones(1, 4)).item() == 5.0


def test_identical_drafter_and_teacher_accepts_everything():
    """Sanity of the acceptance measure: if q == p at every step, α = 1 and E = k + 1."""
    p = torch.softmax(torch.randn(2, 6, 21), -1)
    assert torch.allclose(torch.minimum(p, p).sum(-1), torch.ones(2, 6))


def test_reward_weights_modes():
    r = [0.0, 1.0, 1.0, 0.0]
    w = reward_weights(r, mode="reward", w_min=0.1, w_max=5.0)
    assert w.tolist() == pytest.approx([0.1, 2.0, 2.0, 0.1])
    # Normalized to mean 1 before clipping: no clipping → mean exactly 1.
    w = reward_weights([1.0, 2.0, 3.0], mode="reward", w_min=0.0, w_max=10.0)
    assert w.mean() == pytest.approx(1.0) and w.tolist() == pytest.approx([0.5, 1.0, 1.5])
    # Clipping at the top.
    w = reward_weights([0.0] * 9 + [1.0], mode="reward", w_min=0.1, w_max=3.0)
    assert w[-1] == 3.0 and (w[:-1] == 0.1).all()
    # Negative rewards are shifted so the lowest is 0.
    w = reward_weights([-1.0, 1.0], mode="reward", w_min=0.0, w_max=10.0)
    assert w.tolist() == pytest.approx([0.0, 2.0])
    # All-zero rewards carry no preference: uniform.
    assert reward_weights([0.0, 0.0, 0.0], mode="reward").tolist() == [1.0, 1.0, 1.0]
    # Uniform ignores rewards.
    assert reward_weights([0.0, 5.0], mode="uniform").tolist() == [1.0, 1.0]


def test_advantage_weights_group_normalized():
    r = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.7]
    g = ["a", "a", "a", "a", "z", "z", None]
    w = reward_weights(r, g, mode="advantage", w_min=0.0, w_max=10.0)
    # Group a: mean .5, std .5 → advantages ±1 → raw 2 / 0; zero-reward group z → raw 1; ungrouped → raw 1.
    raw = np.array([2.0, 0.0, 2.0, 0.0, 1.0, 1.0, 1.0])
    assert w.tolist() == pytest.approx((raw / raw.mean()).tolist(), abs=1e-5)
    assert w.mean() == pytest.approx(1.0)
    # Every group equal → all weights 1.
    assert reward_weights([0.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], mode="advantage").tolist() == [1.0] * 4
    w = reward_weights(r, g, mode="advantage", w_min=0.5, w_max=1.2)
    assert w.min() >= 0.5 and w.max() <= 1.2


def test_weights_reject_bad_input():
    with pytest.raises(ValueError, match="finite"):
        reward_weights([1.0, math.nan])
    with pytest.raises(ValueError, match="w_min"):
        reward_weights([1.0], w_min=2.0, w_max=1.0)
    with pytest.raises(ValueError, match="mode"):
        reward_weights([1.0], mode="bogus")  # type: ignore[arg-type]
