"""The native forward covers every architecture the engine accepts, not only Llama: Qwen2 (q/k/v biases),
Qwen3 (per-head q/k RMSNorm) and Mistral. Each is checked against HF's own forward (logits of a prefill,
then decode steps through the cache at ragged positions) and against HF `generate` for greedy decoding
through the engine with a drafter, on a random tiny model saved and loaded with `from_pretrained`."""

from __future__ import annotations

import pytest
import torch
import transformers
from engine_helpers import hf_greedy
from tailspec.rollout import model_runner
from tailspec.rollout.drafters import DraftModelProposer, NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.model_runner import ModelRunner
from tailspec.rollout.sequence import SamplingParams

COMMON = dict(
    vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False,
)
ARCHS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request, tmp_path_factory):
    cfg_cls, model_cls, extra = ARCHS[request.param]
    torch.manual_seed(7)
    m = model_cls(cfg_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them count (Qwen2 has q/k/v biases)
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    d = tmp_path_factory.mktemp(request.param)
    m.save_pretrained(d)
    loaded = model_cls.from_pretrained(d).eval()
    assert loaded.config.model_type == request.param
    return loaded


@pytest.fixture(params=["enable_gqa", "folded"])
def gqa_path(request, monkeypatch):
    """Both ways the runner computes grouped-query attention: query heads folded into the query length (CUDA's,
    model_runner.gqa_attention) and SDPA's `enable_gqa` (the CPU's)."""
    monkeypatch.setattr(model_runner, "FOLD_GQA_DEVICES", ("cuda", "cpu") if request.param == "folded" else ())
    return request.param


def test_runner_forward_matches_hf(model, gqa_path):
    prompts = [[1, 5, 9, 13, 17, 21, 25], [1, 30, 31], [1, 7, 7, 7, 40]]
    runner = ModelRunner(model, max_slots=3, cache_len=64)
    lengths = [len(p) for p in prompts]
    T = max(lengths)
    ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    logits, _ = runner.forward(ids, torch.zeros(3, dtype=torch.long))
    for r, p in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[r, : len(p)], ref, rtol=1e-4, atol=1e-4)
    # two decode steps of width 2 at each row's own position, through the cache
    extra = [[11, 12, 13, 14], [20, 21, 22, 23], [3, 4, 5, 6]]
    for step in range(2):
        start = torch.tensor([L + 2 * step for L in lengths])
        ids = torch.tensor([e[2 * step : 2 * step + 2] for e in extra])
        logits, _ = runner.forward(ids, start)
        for r, p in enumerate(prompts):
            seq = p + extra[r][: 2 * step + 2]
            with torch.no_grad():
                ref = model(torch.tensor([seq])).logits[0, -2:]
            torch.testing.assert_close(logits[r], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_engine_greedy_matches_hf_generate(model, drafter, gqa_path):
    prompts = [[1] + [3 + (i * 7 + j * 5) % 50 for j in range(2 + 3 * i)] for i in range(5)]
    refs = [hf_greedy(model, p, 24) for p in prompts]
    d = NgramProposer() if drafter == "ngram" else DraftModelProposer(model)
    eng = Engine(model, d, selector=3, max_batch=3, max_seq_len=128)
    outs = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    for o, r in zip(outs, refs):
        assert o.token_ids == r
