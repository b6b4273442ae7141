"""`tailspec train` then `tailspec export` end to end (in-process CLI, micro policy)."""

from __future__ import annotations

import json

import torch
from tailspec.drafter_trainer.export import load_export

from tailspec.cli import main

torch.set_num_threads(1)


def test_train_then_export(tmp_path, capsys):
    from tests.trainer_data import policy_samples

    policy, samples = policy_samples("micro", n=96, seed=3)
    f = tmp_path / "samples.jsonl"
    lines = [s.model_dump_json() for s in samples] + ['{"prompt_ids": "oops"}', ""]
    f.write_text("\n".join(lines))
    out = tmp_path / "drafter"
    assert main(["train", "--policy", str(policy), "--samples", str(f), "--steps", "6", "--eval-every", "3",
                 "--out", str(out), "--set", "trainer.batch_size=4", "--set", "trainer.holdout_fraction=0.2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["total_steps"] == 6 and summary["version"]["version"] == 1 and summary["version"]["promoted"]
    # Resuming continues from the checkpoint.
    assert main(["train", "--policy", str(policy), "--samples", str(f), "--steps", "2", "--out", str(out),
                 "--set", "trainer.batch_size=4", "--set", "trainer.holdout_fraction=0.2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["total_steps"] == 8

    hf = tmp_path / "hf"
    assert main(["export", "--format", "hf", "--out", str(hf), "--policy", str(policy),
                 "--versions-dir", str(out / "versions"), "--version", "1"]) == 0
    d = load_export(hf)
    assert d.embed_tokens is not None and d.config.aux_layer_ids == (0, 1, 2)
    # The micro policy has 2 layers: its aux ids (0, 1, 2) cannot be served by vLLM/SGLang, and export says so.
    assert main(["export", "--format", "eagle3", "--out", str(tmp_path / "e3"),
                 "--versions-dir", str(out / "versions")]) == 2
    assert "outside 1..1" in capsys.readouterr().err
    assert not (tmp_path / "e3").exists()
    assert main(["export", "--format", "hf", "--out", str(hf), "--policy", str(policy),
                 "--versions-dir", str(out / "versions")]) == 2  # exists, no --force
    assert main(["export", "--out", str(tmp_path / "x"), "--versions-dir", str(out / "versions"),
                 "--version", "7"]) == 2
    assert "version 7 not found" in capsys.readouterr().err
