"""tailspec.drafter_load.load_drafter, the one way a drafter reaches an engine: the native engine gets the module
over its target's embedding, on the target's device, in its dtype; a live vLLM (LiveVllm's `prepare` hook) gets
the EAGLE-3 directory of a version in tailspec's format, exported once and reused; no vLLM needed."""

from __future__ import annotations

import pytest
import torch


def _policy_and_version(tmp_path):
    from tailspec.core.state import DrafterVersion
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
    from transformers import AutoConfig

    from tailspec.tasks.policy import get_policy

    policy = get_policy("tiny", progress=False)
    torch.manual_seed(0)
    drafter = Eagle3Module(Eagle3Config.from_target(AutoConfig.from_pretrained(policy)))
    drafter.save(tmp_path / "v00007")
    info = DrafterVersion(version=7, path=str(tmp_path / "v00007"), policy_version=0, promoted=True, created_at=0.0)
    return policy, drafter, info


def test_a_tailspec_version_is_exported_once_for_vllm(tmp_path):
    from tailspec.drafter_trainer.export import load_export
    from tailspec.rollout.vllm_checks import DrafterMismatch, eagle3_problems, read_json
    from tailspec.rollout.vllm_live import servable_dir

    from tailspec.drafter_load import load_drafter

    policy, drafter, info = _policy_and_version(tmp_path)
    with pytest.raises(DrafterMismatch, match="not an EAGLE-3 export.*load_drafter"):
        servable_dir(info)  # LiveVllm's default hook refuses a tailspec-format directory, naming the fix

    out = load_drafter(info)
    assert out == tmp_path / "v00007-eagle3"
    assert eagle3_problems(read_json(policy, "policy"), out) == []  # what VllmRollout checks before loading
    assert torch.equal(load_export(out).fc.weight, drafter.fc.weight)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert load_drafter(info) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp  # once
    assert load_drafter(info.path) == out  # a directory as well as its version record
    exported = info.model_copy(update={"path": str(out)})
    assert load_drafter(exported) == out == servable_dir(exported)  # an export is served as is


def test_the_native_engine_gets_the_module_over_its_targets_embedding(tmp_path):
    from tailspec.drafter_trainer.model import Eagle3Module

    from tailspec.drafter_load import load_drafter
    from tailspec.tasks.policy import load_policy

    policy, drafter, info = _policy_and_version(tmp_path)
    target, _ = load_policy(policy, dtype=torch.bfloat16)
    got = load_drafter(info.path, target)
    assert isinstance(got, Eagle3Module)
    assert got.embed_tokens is target.get_input_embeddings()  # shared with the target, as the engine reads it
    assert got.fc.weight.dtype == torch.bfloat16 and got.fc.weight.device == target.device
    assert torch.equal(got.fc.weight, drafter.fc.weight.to(torch.bfloat16))
    assert load_drafter(info, target, dtype=torch.float32).fc.weight.dtype == torch.float32
