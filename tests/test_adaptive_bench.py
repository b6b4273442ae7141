"""`tailspec bench adaptive --json`: the last stdout line is one JSON object with the issue's keys (a tiny run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engine_helpers import micro_policy


@pytest.mark.slow
def test_bench_adaptive_json_contract():
    micro_policy()  # make sure the cached policy exists before the subprocess looks for it
    cmd = [sys.executable, "-m", "tailspec.cli", "bench", "adaptive", "--json", "--target", "micro",
           "--drafter", "ngram", "--batches", "1,3", "--ks", "0,2", "--repeats", "1", "--steps", "2",
           "--longtail-n", "4", "--max-tokens", "24"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert [row["batch"] for row in r["per_batch"]] == [1, 3]
    for row in r["per_batch"]:
        assert set(row) >= {"batch", "oracle_k", "oracle_tps", "adaptive_tps", "beg_tps", "threshold_tps", "nospec_tps"}
        assert row["oracle_tps"] == max(row["fixed_tps"].values()) and row["oracle_k"] in (0, 2)
        assert all(v > 0 for v in row["fixed_tps"].values())
    assert r["adaptive_vs_oracle_min_ratio"] == pytest.approx(
        min(x["adaptive_tps"] / x["oracle_tps"] for x in r["per_batch"]), abs=1e-3)
    assert set(r["longtail_speedup_vs_nospec"]) == {"adaptive", "beg", "threshold"}
    sched = r["adaptive_schedule"]
    assert sched[0][0] == 1 and sched[-1][1] == 3
    assert "graph_pool" not in r  # CPU: no capture
