"""Drafters served by vLLM (CPU build) decode greedily token-identical to vLLM without speculation: the
trainer's EAGLE-3 export, its HF-format export, a draft model (the micro policy, same tokenizer) and n-gram."""

from __future__ import annotations

import pytest
from vllm_helpers import MAX_TOKENS, drafters, engine_kwargs, micro, prompts, tiny, token_ids

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def reference():
    from tailspec.rollout.vllm_backend import VllmRollout, greedy

    ro = VllmRollout(tiny(), None, **engine_kwargs())
    try:
        res = ro.generate(prompts(), greedy(MAX_TOKENS))
    finally:
        ro.close()
    assert res.counters.drafts == 0  # really no speculation
    assert all(len(t) > 5 for t in token_ids(res))
    return res


def serve(spec, **kw):
    from tailspec.rollout.vllm_backend import VllmRollout, greedy

    ro = VllmRollout(tiny(), spec, **engine_kwargs(**kw))
    try:
        return ro.generate(prompts(), greedy(MAX_TOKENS))
    finally:
        ro.close()


def check_against(reference, res):
    assert token_ids(res) == token_ids(reference)
    assert res.counters.drafts > 0 and res.counters.mean_k > 0  # speculation really ran
    # per-request counters (vLLM's per_request_spec_decode_metrics) add up to the engine's counters
    assert sum(c.draft_tokens for c in res.completions) == res.counters.draft_tokens
    assert sum(c.accepted_tokens for c in res.completions) == res.counters.accepted_tokens
    assert all(c.acceptance_length is not None and c.acceptance_length >= 1.0 for c in res.completions)


def test_eagle3_export_greedy_identical(reference):
    from tailspec.rollout.vllm_backend import DrafterSpec

    res = serve(DrafterSpec("eagle3", drafters()["trained"], k=3))
    check_against(reference, res)
    assert res.counters.accepted_tokens > 0 and res.counters.mean_k == 3.0


def test_hf_export_greedy_identical(reference):
    from tailspec.rollout.vllm_backend import DrafterSpec

    res = serve(DrafterSpec("eagle3", drafters()["trained_hf"], k=3))
    check_against(reference, res)
    assert res.counters.accepted_tokens > 0


def test_draft_model_greedy_identical(reference):
    from tailspec.rollout.vllm_backend import DrafterSpec

    check_against(reference, serve(DrafterSpec("draft_model", micro(), k=2)))


def test_other_target_refused_before_vllm_starts(tmp_path, monkeypatch):
    """A drafter exported for another target (hidden size 128) is refused by tailspec; vLLM's LLM is never
    constructed."""
    import torch
    import vllm
    from tailspec.drafter_trainer.export import export
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
    from tailspec.rollout.vllm_backend import DrafterMismatch, DrafterSpec, VllmRollout
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(tiny())
    tc.hidden_size, tc.head_dim, tc.vocab_size = 128, 32, tc.vocab_size + 8
    torch.manual_seed(0)
    other = export(Eagle3Module(Eagle3Config.from_target(tc)), tmp_path / "other")

    def no_llm(*a, **k):
        raise AssertionError("vLLM was started for a drafter that does not fit")

    monkeypatch.setattr(vllm, "LLM", no_llm)
    with pytest.raises(DrafterMismatch) as e:
        VllmRollout(tiny(), DrafterSpec("eagle3", other, k=3), **engine_kwargs())
    msg = str(e.value)
    assert "hidden size 128, target has 256" in msg and f"vocab_size: drafter {tc.vocab_size}, target" in msg


def test_ngram_greedy_identical(reference, monkeypatch):
    """n-gram runs vLLM's engine core in its own process: its proposer imports numba/llvmlite, and an
    in-process engine started after that in the same process fails in vLLM 0.32's kernel rebinding scan
    (AttributeError on llvmlite's _lib_fn_wrapper). Last in this module for the same reason."""
    from tailspec.rollout.vllm_backend import DrafterSpec

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    check_against(reference, serve(DrafterSpec("ngram", None, k=2, ngram_max=3)))
