"""The vLLM backend's checks, which run before vLLM starts (so these tests need no vLLM): a drafter for another
target, a malformed EAGLE-3 directory and a bad schedule are refused with the mismatch named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tailspec.drafter_trainer.export import export
from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
from tailspec.rollout import vllm_backend as vb
from tailspec.rollout.vllm_checks import DrafterMismatch, DrafterSpec, check_schedule, speculative_config
from transformers import LlamaConfig


def target_config(hidden: int = 64, vocab: int = 72, layers: int = 4) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)


def write_target(path: Path, **kw) -> Path:
    target_config(**kw).save_pretrained(path)  # config.json only: the checks never load weights
    return path


def write_drafter(path: Path, draft_vocab: int | None = None, **kw) -> Path:
    torch.manual_seed(0)
    return export(Eagle3Module(Eagle3Config.from_target(target_config(**kw), draft_vocab_size=draft_vocab)), path)


@pytest.fixture
def target(tmp_path) -> Path:
    return write_target(tmp_path / "target")


def test_fitting_drafter_gives_vllm_config(target, tmp_path):
    d = write_drafter(tmp_path / "d")
    conf = speculative_config(DrafterSpec("eagle3", d, k=3, schedule=[(9, 64, 1), (1, 8, 3)]), target)
    assert conf == {"method": "eagle3", "num_speculative_tokens": 3, "model": str(d), "draft_tensor_parallel_size": 1,
                    "num_speculative_tokens_per_batch_size": [(1, 8, 3), (9, 64, 1)]}
    assert json.loads((d / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_smaller_draft_vocab_fits_with_d2t(target, tmp_path):
    d = write_drafter(tmp_path / "d", draft_vocab=32)
    assert vb.eagle3_problems(json.loads((target / "config.json").read_text()), d) == []


@pytest.mark.parametrize("other,named", [
    ({"hidden": 96}, "hidden_size"),
    ({"vocab": 80}, "vocab_size"),
])
def test_drafter_for_another_target_refused(target, tmp_path, other, named):
    d = write_drafter(tmp_path / "d", **other)
    with pytest.raises(DrafterMismatch) as e:
        speculative_config(DrafterSpec("eagle3", d, k=3), target)
    msg = str(e.value)
    assert named in msg and str(next(iter(other.values()))) in msg  # the mismatch and the drafter's value


def test_refused_before_vllm_is_imported(target, tmp_path, monkeypatch):
    """VllmRollout checks before `from vllm import LLM`: with vLLM made unimportable the error is still the
    mismatch, not an ImportError (so no engine was ever started)."""
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    d = write_drafter(tmp_path / "d", hidden=96)
    with pytest.raises(DrafterMismatch, match="hidden_size: drafter expects a target of hidden size 96, target has 64"):
        vb.VllmRollout(target, DrafterSpec("eagle3", d, k=2))


def _edit(d: Path, config=None, drop=(), add=None) -> Path:
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if drop or add:
        w = load_file(str(d / "model.safetensors"))
        for k in drop:
            w.pop(k)
        w.update(add or {})
        save_file(w, str(d / "model.safetensors"))
    return d


def _problems(target: Path, d: Path) -> str:
    return "; ".join(vb.eagle3_problems(json.loads((target / "config.json").read_text()), d))


def test_missing_aux_ids_refused_naming_vllm_default(target, tmp_path):
    def strip(c):
        c.pop("eagle_aux_hidden_state_layer_ids")
        c.pop("eagle_config")

    d = _edit(write_drafter(tmp_path / "d"), config=strip)
    p = _problems(target, d)
    assert "eagle_aux_hidden_state_layer_ids is missing" in p and "(2, 2, 1)" in p  # collides on 4 layers


def test_colliding_or_unordered_or_out_of_range_aux_ids_refused(target, tmp_path):
    d = write_drafter(tmp_path / "d")
    for ids, words in (([1, 1, 3], "collide"), ([3, 1, 2], "not ascending"), ([1, 2, 5], "outside 0..4")):
        def put(c, ids=ids):
            c["eagle_aux_hidden_state_layer_ids"] = ids
        assert words in _problems(target, _edit(d, config=put))


def test_weights_that_break_vllm_refused(target, tmp_path):
    d = write_drafter(tmp_path / "d")
    assert "lm_head.weight is missing" in _problems(target, _edit(d, drop=["lm_head.weight"]))
    d = write_drafter(tmp_path / "d2")
    p = _problems(target, _edit(d, add={"d2t": torch.zeros(72, dtype=torch.long)}))
    assert "d2t is present although draft_vocab_size == vocab_size" in p
    d = write_drafter(tmp_path / "d3")
    p = _problems(target, _edit(d, add={"fc.weight": torch.zeros(64, 128)}))
    assert "fc.weight [64, 128]: expected [64, 3 × 64]" in p
    d = write_drafter(tmp_path / "d4", draft_vocab=32)
    assert "d2t is missing" in _problems(target, _edit(d, drop=["d2t"]))


def test_not_an_eagle3_directory(target, tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(DrafterMismatch, match="has no config.json"):
        speculative_config(DrafterSpec("eagle3", tmp_path / "x"), target)
    with pytest.raises(DrafterMismatch, match="is an EAGLE-3 directory: use method eagle3"):
        speculative_config(DrafterSpec("draft_model", write_drafter(tmp_path / "d")), target)


def test_draft_model_vocab_checked(target, tmp_path):
    write_target(tmp_path / "small", hidden=32, vocab=50)
    with pytest.raises(DrafterMismatch, match="vocab_size: draft model 50, target 72"):
        speculative_config(DrafterSpec("draft_model", tmp_path / "small", k=2), target)
    write_target(tmp_path / "ok", hidden=32)
    assert speculative_config(DrafterSpec("draft_model", tmp_path / "ok", k=2), target)["method"] == "draft_model"


def test_ngram_config(target):
    conf = speculative_config(DrafterSpec("ngram", None, k=3, ngram_max=3), target)
    assert conf == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("schedule,match", [
    ([(2, 8, 3)], "must start at batch size 1"),
    ([(1, 8, 3), (8, 16, 1)], "overlap"),
    ([(1, 8, 5)], "k must be in 0..4"),
    ([(1, 0, 2)], "1 <= start <= end"),
    ([(1, 8)], "expected \\(first batch size, last batch size, k\\)"),
    ([], "must start at batch size 1"),
])
def test_bad_schedule_refused(schedule, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(schedule, k_max=4)


def test_schedule_sorted_gaps_allowed():
    # vLLM carries the previous k over a gap; tailspec passes gaps through unchanged
    assert check_schedule([[17, 64, 0], [1, 4, 4], [5, 8, 2]], 4) == [(1, 4, 4), (5, 8, 2), (17, 64, 0)]


def test_counters_from_metrics():
    from types import SimpleNamespace as M

    c = vb.counters_from_metrics([
        M(name="vllm:spec_decode_num_drafts", value=10), M(name="vllm:spec_decode_num_draft_tokens", value=30),
        M(name="vllm:spec_decode_num_accepted_tokens", value=12),
        M(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[6, 4, 2]),
        M(name="vllm:num_requests_running", value=3),
    ])
    assert (c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos) == (10, 30, 12, [6, 4, 2])
    assert c.acceptance_length == pytest.approx(2.2) and c.mean_k == 3.0 and c.acceptance_rate == pytest.approx(0.4)
    d = c - vb.SpecCounters(4, 12, 2, [1, 1, 0])
    assert (d.drafts, d.draft_tokens, d.accepted_tokens, d.accepted_per_pos) == (6, 18, 10, [5, 3, 2])


def test_the_draft_model_is_found_on_vllm_runners_with_and_without_get_draft_model():
    """vLLM 0.32's runner has `get_draft_model()`; 0.24 (verl 0.9.1's pin) and 0.29 keep the model on the proposer,
    wrapped when CUDA graphs captured it. Checked against stand-ins of both shapes (the attribute names read
    from vLLM 0.24's gpu_model_runner.py and compilation/cuda_graph.py)."""
    from types import SimpleNamespace

    from tailspec.rollout.vllm_worker_ext import draft_model

    m = object()
    assert draft_model(SimpleNamespace(get_draft_model=lambda: m)) is m
    assert draft_model(SimpleNamespace(drafter=SimpleNamespace(model=m))) is m
    wrapped = SimpleNamespace(unwrap=lambda: m)
    assert draft_model(SimpleNamespace(drafter=SimpleNamespace(model=wrapped))) is m
    assert draft_model(SimpleNamespace(drafter=None)) is None and draft_model(SimpleNamespace()) is None
