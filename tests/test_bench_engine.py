"""`tailspec bench engine --json`: the last stdout line is one JSON object with the issue's keys, plus the
per-step time of every engine row and the memory floor it is set beside (a tiny run on the micro policy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engine_helpers import micro_policy

from tailspec.bench.engine import memory_floor


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


def test_memory_floor_is_weight_bytes_over_copy_bandwidth():
    model = micro_policy()[0]
    f = memory_floor(model, "cpu", nbytes=16 << 20, repeats=3)
    assert f["copy_bandwidth_gb_s"] > 0
    want_ms = f["weight_bytes"] / (f["copy_bandwidth_gb_s"] * 1e9) * 1e3
    assert f["floor_ms_per_step"] == pytest.approx(want_ms, rel=0.01)
