"""`tailspec bench engine --json`: the last stdout line is one JSON object with the issue's keys, plus the
per-step time of every engine row and the memory floor it is set beside (a tiny run on the micro policy),
and the EAGLE-3 drafter's cost beside a target forward (`drafter_cost_ratio`, per batch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engine_helpers import micro_policy, random_eagle3, task_prompts
from tailspec.benchmarks.engine import _cost_section, drafter_cost, memory_floor


@pytest.mark.slow
def test_bench_engine_json_contract():
    micro_policy()  # the cached policy must exist before the subprocess looks for it
    cmd = [sys.executable, "-m", "tailspec.cli", "bench", "engine", "--json", "--policy", "micro", "--draft-policy", "",
           "--drafters", "ngram", "--batches", "1,2", "--ks", "1,2", "--repeats", "1", "--max-tokens", "12"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(r) >= {"device", "rows", "summary", "memory_floor"}
    assert set(r["summary"]) >= {"nospec_vs_hf_min_ratio", "best_spec_vs_hf_batch1_ratio", "best_spec_vs_hf_batch16_ratio"}
    methods = {(row["batch"], row["method"], row["k"]) for row in r["rows"]}
    assert methods == {(b, m, k) for b in (1, 2) for m, k in [("hf_generate", None), ("engine", 0), ("engine", 1), ("engine", 2)]}
    for row in r["rows"]:
        assert set(row) >= {"batch", "method", "drafter", "k", "tokens_per_s", "acceptance_length"}
        assert row["tokens_per_s"] > 0
        if row["method"] == "engine":
            assert row["step_ms"] > r["memory_floor"]["floor_ms_per_step"] > 0  # no step beats the floor
    assert r["memory_floor"]["weight_bytes"] == sum(p.numel() * 4 for p in micro_policy()[0].parameters())
    # the drafter's cost beside a target forward, at batch 1 and at every batch size measured
    assert set(r["drafter_cost_ratios"]) == {"1", "2"}
    assert r["drafter_cost_ratio"] == r["drafter_cost_ratios"]["1"] > 0
    per = {row["batch"]: row for row in r["drafter_cost"]["per_batch"]}
    assert set(per) == {1, 2} and r["drafter_cost"]["target_layers"] == 2
    for b, row in per.items():
        assert row["target_forward_ms"] > 0 and row["drafter_step_ms"] > 0
        assert row["ratio"] == r["drafter_cost_ratios"][str(b)]
        assert row["ratio"] == pytest.approx(row["drafter_step_ms"] / row["target_forward_ms"], rel=0.01)
    assert "drafter cost b=1" in p.stderr


def test_memory_floor_is_weight_bytes_over_copy_bandwidth():
    model = micro_policy()[0]
    f = memory_floor(model, "cpu", nbytes=16 << 20, repeats=3)
    assert f["copy_bandwidth_gb_s"] > 0
    want_ms = f["weight_bytes"] / (f["copy_bandwidth_gb_s"] * 1e9) * 1e3
    assert f["floor_ms_per_step"] == pytest.approx(want_ms, rel=0.01)


def test_drafter_cost_times_both_at_each_batch():
    from tailspec.tasks.policy import build_model

    target = build_model("micro").eval()
    r = drafter_cost(target, random_eagle3(target), [1, 3], task_prompts(4), steps=4, calls=3, repeats=1)
    assert list(r) == [1, 3]
    for row in r.values():
        assert set(row) == {"target_forward_ms", "drafter_step_ms", "ratio"}
        assert row["target_forward_ms"] > 0 and row["drafter_step_ms"] > 0
        assert row["ratio"] == pytest.approx(row["drafter_step_ms"] / row["target_forward_ms"], rel=0.01)


def test_cost_section_json_keys_and_skip():
    import argparse

    from tailspec.tasks.policy import build_model
    from tailspec.tasks.tokenizer import build_tokenizer

    target, tok = build_model("micro").eval(), build_tokenizer()
    args = argparse.Namespace(eagle3="", device="cpu", dtype="float32", temperature=1.0, cost_repeats=1)
    lines: list[str] = []
    r = _cost_section(target, None, tok, [1, 2], args, lines.append)
    assert set(r) == {"drafter_cost_ratio", "drafter_cost_ratios", "drafter_cost"}
    assert r["drafter_cost_ratio"] == r["drafter_cost_ratios"]["1"] > 0 and set(r["drafter_cost_ratios"]) == {"1", "2"}
    assert [row["batch"] for row in r["drafter_cost"]["per_batch"]] == [1, 2]
    assert len(lines) == 2 and lines[0].startswith("drafter cost b=1")
    args.cost_repeats = 0
    assert _cost_section(target, None, tok, [1], args, lines.append) == {
        "drafter_cost_ratio": None, "drafter_cost_ratios": {}, "drafter_cost": None}


def test_deep_preset_drafter_is_a_small_fraction_of_a_target_forward():
    """The point of the `deep` preset: its one-layer EAGLE-3 drafter step costs a small fraction of a target
    forward (tiny's: about half). The bound is loose (the issue's is 1/8, measured ~1/13 by the bench) so a
    busy shared machine does not fail it; a drafter as costly as on `tiny` would."""
    from tailspec.tasks.policy import build_model

    target = build_model("deep").eval()
    r = drafter_cost(target, random_eagle3(target), [1], task_prompts(4), steps=4, calls=10, repeats=2)
    assert r[1]["ratio"] < 0.25
