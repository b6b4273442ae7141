"""EAGLE-3 drafter model: shapes, cache vs. plain attention, TTT unroll == inference drafting, aux capture,
vocab maps, fits, checkpoint round trip."""

from __future__ import annotations

import pytest
import torch
from tailspec.drafter_trainer.eagle3_config import Eagle3Config, default_aux_layer_ids
from tailspec.drafter_trainer.layers import DrafterCache, TTTState
from tailspec.drafter_trainer.model import Eagle3Module, capture_aux, vocab_maps_from_counts
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)


def make_target(layers: int = 4, vocab: int = 21, hidden: int = 32, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def make_drafter(target, draft_vocab: int | None = None, seed: int = 1) -> Eagle3Module:
    torch.manual_seed(seed)
    d = Eagle3Module(Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab),
                      target.get_input_embeddings())
    # Non-trivial norms so a swapped concat order or a missing norm shows up.
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return d.eval()


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert default_aux_layer_ids(7) == (2, 3, 4)
    assert default_aux_layer_ids(4) == (1, 2, 3)
    assert default_aux_layer_ids(2) == (0, 1, 2)
    for n in range(2, 40):
        ids = default_aux_layer_ids(n)
        assert len(set(ids)) == 3 and all(0 <= i <= n for i in ids)
    with pytest.raises(ValueError, match="1 layer"):
        default_aux_layer_ids(1)


def test_capture_aux_matches_hf_hidden_states():
    target = make_target(layers=4)
    ids = torch.randint(0, 21, (2, 9))
    with capture_aux(target, (1, 2, 4)) as got:
        out = target(ids, output_hidden_states=True)
    hs = out.hidden_states
    aux = got[0]
    assert aux.shape == (2, 9, 3 * 32)
    assert torch.equal(aux[..., :32], hs[1]) and torch.equal(aux[..., 32:64], hs[2])
    # transformers 5 returns the last entry after the final norm; capture_aux takes the pre-norm stream.
    assert not torch.allclose(aux[..., 64:], hs[4])
    assert torch.allclose(target.model.norm(aux[..., 64:]), hs[4], atol=1e-6)
    with capture_aux(target, (0, 1, 2)) as got:
        target(ids)
    assert torch.equal(got[0][..., :32], target.model.embed_tokens(ids))


def test_cache_forward_equals_plain_forward():
    target = make_target()
    d = make_drafter(target)
    b, t, h = 2, 7, 32
    hidden = torch.randn(b, t, h)
    ids = torch.randint(0, 21, (b, t))
    pos = torch.arange(t).expand(b, t)
    logits, out = d(hidden, ids, pos)
    cache = DrafterCache.allocate(d.config, max_slots=4, max_len=16)
    slots = torch.tensor([3, 1])
    # Two chunks of ragged sizes through the cache give the same result as one causal pass.
    l1, o1 = d(hidden[:, :4], ids[:, :4], pos[:, :4], cache, slots)
    l2, o2 = d(hidden[:, 4:], ids[:, 4:], pos[:, 4:], cache, slots)
    assert torch.allclose(torch.cat([l1, l2], 1), logits, atol=1e-5)
    assert torch.allclose(torch.cat([o1, o2], 1), out, atol=1e-5)
    # Rollback: overwrite position 5 with something else, then rewrite it: the result is back.
    d(torch.randn(b, 1, h), ids[:, 5:6], pos[:, 5:6], cache, slots)
    l3, _ = d(hidden[:, 5:], ids[:, 5:], pos[:, 5:], cache, slots)
    assert torch.allclose(l3, logits[:, 5:], atol=1e-5)


@pytest.mark.parametrize("draft_vocab", [None, 16])
def test_ttt_unroll_matches_inference_drafting(draft_vocab):
    """Step i of the training unroll at anchor t == draft step i+1 of inference from anchor t (module doc)."""
    target = make_target()
    d = make_drafter(target, draft_vocab)
    torch.manual_seed(5)
    b, t_len, steps = 2, 10, 4
    x = torch.randint(0, 21, (b, t_len + steps + 1))
    with capture_aux(target, d.config.aux_layer_ids) as got:
        target(x)
    g = d.project(got[0])
    # Training unroll (teacher-forced chain: the real continuation).
    state = TTTState()
    hidden = g[:, :t_len]
    ttt_logits = []
    for i in range(steps):
        ids = x[:, 1 + i : 1 + i + t_len]
        pos = torch.arange(t_len).expand(b, t_len) + i
        logits, hidden = d.ttt_step(hidden, ids, pos, state)
        ttt_logits.append(logits)
    # Inference: for each anchor m-1, catch up positions 0..m-1 from target states, then draft.
    for anchor in range(t_len):
        cache = DrafterCache.allocate(d.config, max_slots=b, max_len=64)
        slots = torch.arange(b)
        pos = torch.arange(anchor + 1).expand(b, anchor + 1)
        logits, out = d(g[:, : anchor + 1], x[:, 1 : anchor + 2], pos, cache, slots)
        assert torch.allclose(logits[:, -1], ttt_logits[0][:, anchor], atol=1e-5)
        hid = out[:, -1:]
        for i in range(1, steps):
            p = torch.full((b, 1), anchor + i)
            logits, hid = d(hid, x[:, anchor + 1 + i : anchor + 2 + i], p, cache, slots)
            assert torch.allclose(logits[:, 0], ttt_logits[i][:, anchor], atol=1e-5), (anchor, i)


def test_vocab_maps_and_probs():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = vocab_maps_from_counts(counts, 4)
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 5]
    target = make_target(vocab=8)
    d = make_drafter(target, 4)
    d.set_vocab_maps(d2t, t2d)
    assert d.draft_to_target(torch.tensor([0, 1, 2, 3])).tolist() == [0, 2, 3, 5]
    q = d.target_probs(torch.randn(3, 4))
    assert torch.allclose(q.sum(-1), torch.ones(3)) and (q[:, ~t2d] == 0).all()
    with pytest.raises(ValueError, match="disagree"):
        d.set_vocab_maps(d2t, torch.ones(8, dtype=torch.bool))


def test_fits_names_each_mismatch():
    target = make_target(layers=4)
    d = make_drafter(target)
    assert d.fits(target.config) == []
    other = make_target(layers=2, vocab=30, hidden=48)
    problems = d.fits(other.config)
    assert any("vocab_size" in p for p in problems)
    assert any("hidden_size" in p for p in problems)
    assert any("aux_layer_ids" in p and "outside 0..2" in p for p in problems)
    with pytest.raises(ValueError, match="vocab_size"):
        d.check_fits(other.config)
    with pytest.raises(ValueError, match="distinct"):
        Eagle3Config.from_target(target.config, aux_layer_ids=(1, 1, 2))


def test_save_load_round_trip(tmp_path):
    target = make_target()
    d = make_drafter(target, 16)
    d2t, t2d = vocab_maps_from_counts(torch.arange(21).flip(0), 16)
    d.set_vocab_maps(d2t, t2d)
    d.save(tmp_path / "ck")
    d.save(tmp_path / "ck")  # overwrite in place through the atomic swap
    e = Eagle3Module.load(tmp_path / "ck", target.get_input_embeddings())
    for k, v in d.state_dict().items():
        assert torch.equal(v, e.state_dict()[k]), k
    assert "embed_tokens.weight" not in d.state_dict()
    assert not list(tmp_path.glob(".ck.*"))
    hidden, ids, pos = torch.randn(1, 5, 32), torch.randint(0, 21, (1, 5)), torch.arange(5)[None]
    assert torch.equal(d(hidden, ids, pos)[0], e(hidden, ids, pos)[0])
