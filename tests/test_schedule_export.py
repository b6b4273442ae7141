"""A strategy schedule exported for vLLM and SGLang (rollout/schedule_export.py): chains, static and dynamic trees,
plain-decoding ranges, mixed schedules, the settings each engine takes and the errors bad schedules raise."""

from __future__ import annotations

import itertools
import json

import pytest
from tailspec.rollout.schedule_export import (
    OPEN_END,
    normalize,
    schedule_exports,
    sglang_capacity,
    sglang_flags,
    sglang_schedule,
    sglang_setting,
    vllm_k,
    vllm_schedule,
)
from tailspec.rollout.strategy import Strategy
from tailspec.rollout.table_selector import beg_selector, fixed_selector, threshold_selector
from tailspec.rollout.vllm_checks import check_schedule

TREE = Strategy.tree([4, 2, 1], 12)  # depth 3, widest branching 4, 12 nodes verified
DYN = Strategy.dynamic(6, 4, 32)
MIXED = [(1, 1, TREE), (2, 4, DYN), (5, 16, Strategy.chain(3)), (17, 64, 1), (65, 256, 0)]


def vllm_rules_hold(conf: dict) -> None:
    """vLLM 0.32's rules for num_speculative_tokens_per_batch_size (vllm/v1/spec_decode/dynamic/utils.py):
    3-item entries, positive inclusive ranges, sorted and non-overlapping, the first from 1, k >= 0; and
    num_speculative_tokens > 0 covers every k (vLLM would clamp a larger one)."""
    sched, k_max = conf["num_speculative_tokens_per_batch_size"], conf["num_speculative_tokens"]
    assert isinstance(sched, list) and sched and k_max > 0
    assert all(len(e) == 3 and 1 <= e[0] <= e[1] and 0 <= e[2] <= k_max for e in sched)
    assert sched[0][0] == 1 and all(b[0] > a[1] for a, b in itertools.pairwise(sched))
    assert max(e[2] for e in sched) == k_max


# -- chains ---------------------------------------------------------------------------------------------------
def test_chain_schedule_is_vllms_k_schedule_as_is():
    sched = [(1, 8, 4), (9, 32, 2), (33, 256, 0)]
    v = vllm_schedule(sched)
    assert v["speculative_config"] == {"num_speculative_tokens": 4,
                                       "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 32, 2], [33, 256, 0]]}
    vllm_rules_hold(v["speculative_config"])
    assert v["speculative_token_tree"] is None and v["note"] == ""  # no tree ran: nothing to say
    assert [r["runs_as"] for r in v["ranges"]] == ["chain4", "chain2", "none"]
    # Strategy values, labels and ints are the same chains
    same = [(1, 8, Strategy.chain(4)), (9, 32, "chain2"), (33, 256, Strategy.none())]
    assert vllm_schedule(same) == v
    # the export and the backend's own check agree on a chain schedule
    assert [tuple(e) for e in v["speculative_config"]["num_speculative_tokens_per_batch_size"]] == \
        check_schedule(sched, 4)


def test_chain_in_sglang_is_k_steps_of_topk_1_verifying_k_plus_1():
    for k in (1, 3, 8):
        assert sglang_setting(k) == {"speculative_num_steps": k, "speculative_eagle_topk": 1,
                                     "speculative_num_draft_tokens": k + 1}
    s = sglang_schedule([(1, 8, 4), (9, 32, 2), (33, 64, 0)])
    assert [r["speculate"] for r in s["ranges"]] == [True, True, False]
    assert s["setting"] == sglang_setting(2) and s["batch_sizes"] == 24  # 9..32 covers more batch sizes than 1..8
    assert s["flags"] == ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2",
                          "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
    assert s["command_line"] == " ".join(s["flags"])
    assert "cannot switch speculation off" in s["note"]


# -- trees ----------------------------------------------------------------------------------------------------
def test_static_tree_runs_in_vllm_as_a_chain_of_its_depth():
    v = vllm_schedule([(1, 4, TREE), (5, 64, 1)])
    assert v["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 64, 1]]
    assert v["speculative_config"]["num_speculative_tokens"] == 3
    assert v["speculative_token_tree"] is None and "has no token tree" in v["note"]
    assert v["ranges"][0] == {"start": 1, "end": 4, "strategy": "tree4-2-1n12", "num_speculative_tokens": 3,
                              "runs_as": "chain3"}
    assert "speculative_token_tree" not in v["speculative_config"]  # vLLM's SpeculativeConfig refuses unknown fields
    vllm_rules_hold(v["speculative_config"])


def test_static_tree_in_sglang_is_depth_widest_branching_nodes_plus_1():
    assert sglang_setting(TREE) == {"speculative_num_steps": 3, "speculative_eagle_topk": 4,
                                    "speculative_num_draft_tokens": 13}
    assert sglang_setting("tree2-1n3") == {"speculative_num_steps": 2, "speculative_eagle_topk": 2,
                                           "speculative_num_draft_tokens": 4}


def test_static_tree_larger_than_sglang_drafts_is_capped_with_a_note():
    big = Strategy.tree([2, 2, 2], 14)  # the full binary tree of depth 3; SGLang drafts 2 + 2 * 2^2 = 10 nodes
    assert sglang_capacity(3, 2) == 11
    got = sglang_setting(big)
    assert got["speculative_num_draft_tokens"] == 11 and "verifies 15 tokens" in got["note"]
    s = sglang_schedule([(1, 8, big)])
    assert s["ranges"][0]["note"] == got["note"] and "note" not in s["setting"]
    assert s["setting"]["speculative_num_draft_tokens"] == 11


def test_dynamic_tree_is_depth_topk_nodes_plus_1():
    assert vllm_k(DYN) == 6
    assert sglang_setting(DYN) == {"speculative_num_steps": 6, "speculative_eagle_topk": 4,
                                   "speculative_num_draft_tokens": 33}
    # a dynamic tree never drafts more nodes than SGLang's shape of the same depth and topk does
    full = Strategy.dynamic(3, 2, Strategy.dynamic(3, 2, 3).full_nodes)
    assert sglang_setting(full)["speculative_num_draft_tokens"] == full.nodes + 1 == sglang_capacity(3, 2)
    v = vllm_schedule([(1, 8, DYN)])
    assert v["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 8, 6]] and v["note"]


# -- none ranges ----------------------------------------------------------------------------------------------
def test_none_everywhere_means_no_speculation_in_either_engine():
    v = vllm_schedule([(1, 64, 0)])
    assert v["speculative_config"] is None and "without a speculative_config" in v["note"]
    s = sglang_schedule([(1, 8, Strategy.none()), (9, 64, "none")])
    assert s["setting"] is None and s["flags"] == [] and s["batch_sizes"] == 0
    assert s["ranges"] == [{"start": 1, "end": 8, "strategy": "none", "speculate": False},
                                        {"start": 9, "end": 64, "strategy": "none", "speculate": False}]
    assert sglang_flags(None) == []


# -- mixed schedules ------------------------------------------------------------------------------------------
def test_mixed_schedule_both_sections():
    out = schedule_exports(MIXED, draft_model_path="runs/export/eagle3")
    assert out["schedule"] == [[1, 1, "tree4-2-1n12"], [2, 4, "dyn6x4n32"], [5, 16, "chain3"], [17, 64, "chain1"],
                               [65, 256, "none"]]
    v = out["vllm"]
    assert v["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 1, 3], [2, 4, 6], [5, 16, 3], [17, 64, 1], [65, 256, 0]]
    vllm_rules_hold(v["speculative_config"])
    s = out["sglang"]
    assert [(r["strategy"], r.get("speculative_num_steps"), r.get("speculative_eagle_topk"),
             r.get("speculative_num_draft_tokens")) for r in s["ranges"]] == [
        ("tree4-2-1n12", 3, 4, 13), ("dyn6x4n32", 6, 4, 33), ("chain3", 3, 1, 4), ("chain1", 1, 1, 2),
        ("none", None, None, None)]
    assert s["setting"] == sglang_setting(1) and s["batch_sizes"] == 48
    assert s["flags"][:4] == ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "runs/export/eagle3"]
    assert json.loads(json.dumps(out)) == out  # JSON as is


def test_most_common_setting_counts_batch_sizes_merges_equal_settings_and_breaks_ties_low():
    # chain2 twice (1..2 and 9..10: 4 batch sizes) beats chain4 (3..5: 3), though split in two ranges
    s = sglang_schedule([(1, 2, 2), (3, 5, 4), (6, 8, 0), (9, 10, 2)])
    assert s["setting"] == sglang_setting(2) and s["batch_sizes"] == 4
    # a tie goes to the setting at the smaller batch size
    assert sglang_schedule([(1, 3, TREE), (4, 6, 1)])["setting"] == sglang_setting(TREE)
    # max_batch: batch sizes past it do not count
    assert sglang_schedule([(1, 4, 3), (5, 64, 1)], max_batch=6)["setting"] == sglang_setting(3)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        sglang_schedule([(1, 4, 3)], max_batch=0)


def test_open_ended_tables_count_their_last_range_once():
    for sel, expect in ((fixed_selector(3), 3), (threshold_selector(2, gate=8), 2), (beg_selector(4), None)):
        table = sel.table
        assert table[-1][1] >= OPEN_END
        s = sglang_schedule(table)
        if expect is not None:
            assert s["setting"] == sglang_setting(expect)
        vllm_rules_hold(vllm_schedule(table)["speculative_config"])
    # BEG: k 4 at 1, 3 at 2..4, 1 at 5..32, off above 32; k 1 covers the most batch sizes
    assert sglang_schedule(beg_selector(4).table)["setting"] == sglang_setting(1)


def test_a_selectors_schedule_exports():
    out = schedule_exports(threshold_selector(3, gate=4).schedule(16))
    assert out["schedule"] == [[1, 4, "chain3"], [5, 16, "none"]]
    assert out["vllm"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 3], [5, 16, 0]]


# -- the vLLM backend's own check takes strategies ----------------------------------------------------------
def test_backend_check_schedule_takes_strategies_trees_as_their_depth():
    assert check_schedule([(1, 4, TREE), (5, 8, Strategy.chain(2)), (9, 16, Strategy.none())], 3) == \
        [(1, 4, 3), (5, 8, 2), (9, 16, 0)]
    with pytest.raises(ValueError, match="k must be in 0..4"):
        check_schedule([(1, 8, DYN)], 4)  # depth 6 > the drafter's k


# -- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,match", [
    ([], "non-empty list"),
    ("1-8:chain2", "non-empty list"),
    (None, "non-empty list"),
    ([(2, 8, 3)], "must start at batch size 1"),
    ([(1, 4, 3), (6, 8, 1)], "a gap"),
    ([(1, 4, 3), (4, 8, 1)], "an overlap"),
    ([(1, 4, 3), (1, 4, 1)], "an overlap"),
    ([(5, 8, 1), (1, 4, 3)], "must start at batch size 1"),
    ([(1, 0, 2)], "1 <= start <= end"),
    ([(0, 4, 2)], "1 <= start <= end"),
    ([(True, 4, 2)], "must be ints"),
    ([(1, 4.0, 2)], "must be ints"),
    ([(1, 8)], "expected \\(first batch size, last batch size, strategy\\)"),
    ([(1, 8, 2, 0)], "expected \\(first batch size, last batch size, strategy\\)"),
    (["abc"], "expected \\(first batch size, last batch size, strategy\\)"),
    ([(1, 8, -1)], "entry 0 .*k must be an int >= 0"),
    ([(1, 8, 2.5)], "not a strategy"),
    ([(1, 8, True)], "not a strategy"),
    ([(1, 8, "tree9")], "not a strategy label"),
])
def test_bad_schedules_are_refused_naming_the_entry(schedule, match):
    for export in (normalize, vllm_schedule, sglang_schedule, schedule_exports):
        with pytest.raises(ValueError, match=match):
            export(schedule)
