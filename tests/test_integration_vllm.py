"""tailspec.integrations.vllm: a promoted version in tailspec's drafter format becomes the EAGLE-3 directory a
live vLLM loads (LiveVllm's `prepare` hook), exported once and reused; no vLLM needed."""

from __future__ import annotations

import pytest
import torch


def test_export_version_exports_a_tailspec_version_once_for_vllm(tmp_path):
    from tailspec.core.state import DrafterVersion
    from tailspec.drafter_trainer.export import load_export
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
    from tailspec.rollout.vllm_checks import DrafterMismatch, eagle3_problems, read_json
    from tailspec.rollout.vllm_live import servable_dir
    from transformers import AutoConfig

    from tailspec.integrations.vllm import export_version
    from tailspec.tasks.policy import get_policy

    policy = get_policy("tiny", progress=False)
    torch.manual_seed(0)
    drafter = Eagle3Module(Eagle3Config.from_target(AutoConfig.from_pretrained(policy)))
    drafter.save(tmp_path / "v00007")
    info = DrafterVersion(version=7, path=str(tmp_path / "v00007"), policy_version=0, promoted=True, created_at=0.0)
    with pytest.raises(DrafterMismatch, match="not an EAGLE-3 export"):
        servable_dir(info)  # the default hook refuses a tailspec-format directory, naming the fix

    out = export_version(info)
    assert out == tmp_path / "v00007-eagle3"
    assert eagle3_problems(read_json(policy, "policy"), out) == []  # what VllmRollout checks before loading
    assert torch.equal(load_export(out).fc.weight, drafter.fc.weight)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert export_version(info) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp  # once
    exported = info.model_copy(update={"path": str(out)})
    assert export_version(exported) == out == servable_dir(exported)  # an export is served as is
