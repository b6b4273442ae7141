"""`tailspec bench faults`: one drill of each kind in a short co-trained RL loop (real redis-server with AOF,
two scheduler processes, real sessions and workers): nothing left lent to a dead session, nothing corrupt,
no acknowledged sample lost, every step hit by a fault completed."""

import argparse

import pytest
from tailspec.benchmarks import faults


@pytest.mark.drill
def test_one_drill_of_each_kind_costs_nothing_but_time(tmp_path):
    p = argparse.ArgumentParser()
    faults.add_arguments(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    # the demo test's policy and bootstrap (cached by the demo test or built here: ~10 s), a tail every step
    args = p.parse_args(["--policy", "tiny", "--workers", "2", "--prompts", "32", "--group", "4", "--per-kind", "1",
                         "--steps", "20", "--gap", "0.5", "1.0", "--bootstrap-samples", "64",
                         "--bootstrap-seconds", "5", "--deal", "by_length", "--out", str(tmp_path), "--json",
                         "--set", "scheduler.leader_ttl_s=1", "--set", "scheduler.lease_ttl_s=1"])  # shorter waits
    res = faults.run(args)
    assert res["run_error"] is None and not res["drill_errors"], (res["run_error"], res["drill_errors"])
    assert res["redis_persistence"] == "aof appendfsync everysec"
    for kind in faults.KINDS:
        f = res["faults"][kind]
        assert f["injections"] == 1, (kind, f)
        assert f["gpus_still_lent"] == 0 and f["corrupt_dirs"] == 0 and f["not_recovered"] == 0, (kind, f)
        assert f["steps_completed"] == f["steps_hit"] == 1, (kind, f)
        assert f["recover_s_max"] is not None and f["recover_s_max"] >= 0, (kind, f)
    assert res["faults"]["redis"]["samples_lost_beyond_everysec"] == 0  # only the last second may be lost
    # a scheduler's take-over waits out the leader key (its TTL) and no more than a few ticks beyond
    assert res["faults"]["scheduler"]["recover_s_max"] <= res["leader_ttl_s"] + 1.5
    assert res["worker_restarts"] == 1
    assert res["gpus_still_lent_at_end"] == 0 and res["corrupt_dirs_at_end"] == []
