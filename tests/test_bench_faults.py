"""`tailspec bench faults`: its detectors (a lease no live session holds, a head directory that does not load, a
sample missing from the stream) each silent on a clean state and firing on its planted fault, in seconds on a
private redis-server and temp directories; and, marked `drill` (`make test-faults`), one drill of each kind in a
short co-trained RL loop (real redis-server with AOF, two scheduler processes, real sessions and workers): nothing
left lent to a dead session, nothing corrupt, no sample lost, every step hit by a fault completed, and every
detector firing on the fault `--plant` plants in the run's own state."""

import argparse
import os
import subprocess
import time

import pytest
import torch
from tailspec.benchmarks import faults
from tailspec.core import state
from tailspec.core.state import Sample, SessionInfo
from tailspec.drafter_trainer.lineage import Lineage
from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module
from tailspec.scheduler.client import TailspecClient
from tailspec.scheduler.leases import Leases


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
                         "--plant",
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
        assert f["samples_checked"] > 0 and f["samples_lost_beyond_everysec"] == 0, (kind, f)
    for kind in ("scheduler", "session", "worker"):  # only a Redis kill may lose the last second's samples
        assert res["faults"][kind]["samples_lost"] == 0, (kind, res["faults"][kind])
    # a scheduler's take-over waits out the leader key (its TTL) and no more than a few ticks beyond
    assert res["faults"]["scheduler"]["recover_s_max"] <= res["leader_ttl_s"] + 1.5
    assert res["worker_restarts"] == 1
    assert res["gpus_still_lent_at_end"] == 0 and res["corrupt_dirs_at_end"] == []
    assert res["plant_ok"], res["plant"]


# -- the detectors, each on a clean state and on its planted fault (private redis-server, temp dirs) ----------------
def tiny_drafter() -> Eagle3Module:
    cfg = Eagle3Config(target_hidden_size=16, hidden_size=16, vocab_size=32, draft_vocab_size=32, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=64, aux_layer_ids=(1, 2, 3), target_num_layers=4)
    torch.manual_seed(0)
    return Eagle3Module(cfg)


def submit(client: TailspecClient, version: int, n: int = 4, group: str = "g") -> None:
    client.submit_samples([Sample(prompt_ids=[1, 2], response_ids=[3, i], reward=1.0, policy_version=version,
                                  group_id=f"{group}:{i}") for i in range(n)])
    assert client.flush(5.0)


def test_samples_lost_counts_a_dropped_sample_and_not_the_clients_trim(redis_url, redis_client):
    client = TailspecClient(redis_url, cluster="c", node="n", samples_keep_versions=2)
    try:
        submit(client, 0, group="boot")  # the bootstrap's seeds are not the RL loop's
        submit(client, 0)
        submit(client, 1)
        before = faults.stream_samples(redis_client, "c")
        assert sorted(before.values()) == [0] * 4 + [1] * 4
        assert faults.samples_lost(before, faults.stream_samples(redis_client, "c"), 2) == 0
        submit(client, 2)  # the client trims version 0 now: gone by design, not lost
        after = faults.stream_samples(redis_client, "c")
        assert sorted(after.values()) == [1] * 4 + [2] * 4
        assert faults.samples_lost(before, after, 2) == 0
        assert faults.plant_dropped_sample(redis_client, "c", before) == 1
        assert faults.samples_lost(before, faults.stream_samples(redis_client, "c"), 2) == 1
        assert faults.samples_lost(before, {}, 2) == 8  # the whole stream gone: every sample counted
    finally:
        client.close()


def test_orphan_leases_counts_a_lease_no_live_session_holds(redis_client):
    leases = Leases(redis_client, "c")
    live = leases.acquire("n", 0, "sched", 2.0)
    record = SessionInfo(session_id="s0", node="n", gpu=0, lease_token=live.token, status="running",
                         started_at=live.granted_at, pid=os.getpid())
    state.put(redis_client, state.key("c", "session", session_id="s0"), record)
    leases.acquire("n", 1, "sched", 2.0)  # granted this instant: its record is not written yet
    assert faults.orphan_leases(redis_client, "c") == 0
    key = faults.plant_orphan_lease(redis_client, "c", "n", ttl_s=2.0)
    assert key == state.key("c", "lease", node="n", gpu=2)  # the first GPU without a lease
    assert faults.orphan_leases(redis_client, "c") == 1
    assert faults.orphan_leases(redis_client, "c", now=time.time() + 3.0) == 2  # gpu 1's record never came
    dead = subprocess.Popen(["true"])
    dead.wait()
    state.put(redis_client, state.key("c", "session", session_id="s0"), record.model_copy(update={"pid": dead.pid}))
    assert faults.orphan_leases(redis_client, "c") == 2  # its process is gone
    state.put(redis_client, state.key("c", "session", session_id="s0"),
              record.model_copy(update={"status": "stopped"}))
    assert faults.orphan_leases(redis_client, "c") == 2  # its record says stopped


def test_corrupt_dirs_finds_a_half_written_head(tmp_path, redis_client):
    Lineage(tmp_path / "lineage", redis_client, "c").seed(tiny_drafter())
    assert faults.corrupt_dirs(tmp_path) == []
    (tmp_path / "lineage" / ".head-00000002-s-1.tmp.123").mkdir()  # a killed writer's temporary: nobody reads it
    assert faults.corrupt_dirs(tmp_path) == []
    planted = faults.plant_corrupt_head(tmp_path)
    assert planted.name == "head-00001001-plant-1"
    assert [x.split(":")[0] for x in faults.corrupt_dirs(tmp_path)] == [planted.name]
    empty = tmp_path / "empty"
    assert [x.split(":")[0] for x in faults.corrupt_dirs(empty)] == []
    bare = faults.plant_corrupt_head(empty)  # no head to copy: a directory with an empty config alone
    assert [x.split(":")[0] for x in faults.corrupt_dirs(empty)] == [bare.name]


def test_plant_and_detect_reports_every_detector_and_leaves_the_state_clean(tmp_path, redis_url, redis_client):
    Lineage(tmp_path / "lineage", redis_client, "c").seed(tiny_drafter())
    client = TailspecClient(redis_url, cluster="c", node="n")
    try:
        submit(client, 0)
    finally:
        client.close()
    plant = faults.plant_and_detect(redis_client, "c", "n", tmp_path, ttl_s=2.0, keep_versions=8)
    assert plant == {k: {"planted": 1, "planted_detected": 1, "clean": 0}
                     for k in ("corrupt_dirs", "gpus_still_lent", "samples_lost")}
    assert faults.plant_ok(plant)
    assert faults.corrupt_dirs(tmp_path) == [] and faults.orphan_leases(redis_client, "c") == 0
    assert len(faults.stream_samples(redis_client, "c")) == 3  # the deleted sample stays deleted
    missed = {**plant, "samples_lost": {"planted": 1, "planted_detected": 0, "clean": 0}}
    assert not faults.plant_ok(missed) and not faults.plant_ok({})
    assert not faults.plant_ok({"corrupt_dirs": {"planted": 0, "planted_detected": 0, "clean": 0}})
