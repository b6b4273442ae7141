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
        assert row["oracle_tps"] == max(row["fixed_tps"].values()) and row["oracle_k"] in ("none", "chain2")
        assert all(v > 0 for v in row["fixed_tps"].values())
        assert row["twin_ratio"] == pytest.approx(row["repeats_tps"]["twin"][0] / row["repeats_tps"]["chain2"][0], abs=1e-3)
        assert row["adaptive_vs_chain_only"] == pytest.approx(row["adaptive_tps"] / row["adaptive_chain_only_tps"], abs=1e-3)
    for row in r["per_batch"]:  # one repeat: nothing to hold out, so the held-out oracle is the in-sample one
        assert row["oracle_held_out_tps"] == row["oracle_tps"] and row["oracle_held_out_ks"] == [row["oracle_k"]]
        assert row["adaptive_vs_oracle"] == pytest.approx(row["adaptive_tps"] / row["oracle_tps"], abs=1e-3)
    assert r["adaptive_vs_oracle_min_ratio"] == pytest.approx(min(x["adaptive_vs_oracle"] for x in r["per_batch"]), abs=1e-3)
    assert r["adaptive_vs_oracle_in_sample_min_ratio"] == pytest.approx(
        min(x["adaptive_tps"] / x["oracle_tps"] for x in r["per_batch"]), abs=1e-3)
    assert r["twin_ratio_range"] == [min(x["twin_ratio"] for x in r["per_batch"]), max(x["twin_ratio"] for x in r["per_batch"])]
    assert set(r["longtail_speedup_vs_nospec"]) == {"adaptive", "adaptive_chain_only", "beg", "threshold"}
    assert r["strategies"] == ["none", "chain2"]  # the n-gram drafter drafts chains only: no trees in the space
    assert set(r["acceptance_length_at_batch1"]) == {"none", "chain2"}
    assert r["acceptance_length_at_batch1"]["none"] == pytest.approx(1.0)
    assert r["acceptance_length_at_batch1"]["chain2"] >= 1.0
    sched = r["adaptive_schedule"]
    assert sched[0][0] == 1 and sched[-1][1] == 3
    assert "graph_pool" not in r  # CPU: no capture
    assert set(r["adaptive_schedule_export"]) == {"schedule", "vllm", "sglang"}


def test_held_out_oracle_picks_k_on_the_other_repeats():
    """Two near-tied ks whose repeats scatter: the in-sample best median (k2, 11) is the luckier one's; picked on the
    other repeats, each repeat scores the k it did not see: k2 twice (11, 9), k1 once (8); median 9."""
    from tailspec.benchmarks.adaptive import held_out_oracle

    runs = {"none": [1.0, 1.0, 1.0], "chain1": [10.0, 12.0, 8.0], "chain2": [11.0, 9.0, 12.0]}
    ks, tps = held_out_oracle(runs, ["none", "chain1", "chain2"])
    assert ks == ["chain2", "chain2", "chain1"] and tps == [11.0, 9.0, 8.0]
    assert held_out_oracle({"none": [1.0], "chain1": [3.0]}, ["none", "chain1"]) == (["chain1"], [3.0])


def test_with_graphs_each_batch_size_reuses_one_engine_idle_and_reconfigured():
    """Graphs on (a GPU): once a cost table plans the pool, a batch size's engine is built once (its capture is the
    expensive part) and handed back idle with the run's strategy; before that every call builds a fresh one."""
    from tailspec.benchmarks.adaptive import _engine_factory
    from tailspec.core.config import TailspecConfig
    from tailspec.rollout.cost_model import CostModel
    from tailspec.rollout.drafters import NgramProposer
    from tailspec.rollout.sequence import SamplingParams

    from tailspec.tasks.runsum import sample_problems
    from tailspec.tasks.tokenizer import encode_prompt

    model, tok = micro_policy()
    planned: dict = {}
    make = _engine_factory(model, NgramProposer, TailspecConfig(), 160, 3, planned)
    assert make(2, 0) is not make(2, 0)  # no table yet: eager, fresh engines
    planned["cost"] = CostModel([1, 2], [0, 2], {(b, k): 0.01 * (1 + k) for b in (1, 2) for k in (0, 2)})
    eng = make(2, 0)
    eng.add_request(encode_prompt(tok, sample_problems(1, seed=3)[0].prompt), SamplingParams(max_tokens=32, temperature=0.0))
    eng.step()
    assert eng.has_unfinished()
    again = make(2, 2)
    assert again is eng and not again.has_unfinished() and again.selector.name == "fixed_k2"
    assert make(1, 0) is not eng


def test_the_no_sd_baseline_decodes_without_a_drafter():
    """`none` is plain decoding: its engine has no drafter to catch up at every step, with graphs on or off. A
    selector that may draft at some batch size (threshold, a chain, an int given to the warm-up) keeps one."""
    from tailspec.benchmarks.adaptive import _engine_factory, never_drafts
    from tailspec.core.config import TailspecConfig
    from tailspec.rollout.cost_model import CostModel
    from tailspec.rollout.drafters import NgramProposer
    from tailspec.rollout.strategy import Strategy
    from tailspec.rollout.table_selector import fixed_selector, threshold_selector

    none, chain2 = fixed_selector(Strategy.none()), fixed_selector(Strategy.chain(2))
    assert never_drafts(none) and never_drafts(fixed_selector(0))
    assert not any(never_drafts(s) for s in (chain2, threshold_selector(2), 0, 2))
    model, _ = micro_policy()
    for planned in ({}, {"cost": CostModel([1, 2], [0, 2], {(b, k): 0.01 * (1 + k) for b in (1, 2) for k in (0, 2)})}):
        make = _engine_factory(model, NgramProposer, TailspecConfig(), 160, 3, planned)
        plain, spec = make(2, none), make(2, chain2)
        assert plain.drafter is None and spec.drafter is not None
        assert make(2, threshold_selector(2)).drafter is not None and make(2, 0).drafter is not None
        if planned:  # one engine per (batch size, plain or not), reused
            assert make(2, none) is plain and make(2, chain2) is spec
