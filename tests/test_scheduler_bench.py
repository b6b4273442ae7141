"""`tailspec bench scheduler`: its JSON contract with each kind of session, small and fast (no speed asserts),
and the scheduler's batched lease renewal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

COMMON = ("workers", "gpus", "session", "idle_gpu_seconds", "lent_gpu_seconds", "reclaimed_share",
          "detect_latency_p50_s", "detect_latency_p99_s", "release_to_free_p50_s", "release_to_free_p99_s",
          "reclaim_counted_p50_s", "reclaim_counted_p99_s", "scheduler_cpu_share", "tick_p50_s", "tick_p99_s",
          "tick_cpu_p99_s", "round_trips_per_tick_mean", "commands_per_tick_mean", "client_reports_per_s",
          "client_report_calls_per_s", "client_report_writes_per_s", "telemetry")


def bench(*args: str, timeout: int = 300) -> dict:
    out = subprocess.run([sys.executable, "-m", "tailspec.cli", "bench", "scheduler", "--json", "--steps", "1",
                          "--train-s", "0.3", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for k in COMMON:
        assert k in res, k
    for q in ("p50", "p99"):  # the aliases readers of earlier results look up
        assert res[f"release_latency_{q}_s"] == res[f"reclaim_counted_{q}_s"]
    assert res["telemetry"] == "simulated"
    assert res["idle_gpu_seconds"] > 0 and res["detections"] >= 1
    assert 0 < res["tick_p50_s"] <= res["tick_p99_s"] <= res["tick_max_s"]
    assert 1 <= res["round_trips_per_tick_mean"] <= res["round_trips_per_tick_max"]
    assert res["client_reports"] > 0 and res["client_reports_dropped"] == 0
    return res


def test_busy_sessions_are_lent_and_released():
    res = bench("--session", "busy", "--workers", "2")
    assert res["session"] == "busy" and res["workers"] == res["gpus"] == 2
    assert res["sessions_started"] >= 1 and res["sessions_failed"] == 0 and res["session_steps"] > 0
    assert 0 < res["reclaimed_share"] <= 1.2
    assert res["revoked_sessions_ended"] >= 1 and res["release_to_free_p99_s"] is not None


@pytest.mark.slow
def test_many_gpus_on_many_nodes_with_the_sample_stream_bounded():
    # 64 GPUs as 16 replicas of 4 over 8 nodes; no session processes; 12 RL steps' samples (stream keeps 8)
    res = bench("--gpus", "64", "--workers", "16", "--requests-per-worker", "4", "--sample-hours", "0.2",
                "--rl-step-s", "60")
    assert res["session"] == "none" and res["gpus"] == 64 and res["gpus_per_worker"] == 4 and res["nodes"] == 8
    assert res["sessions_started"] >= 1 and res["release_to_free_p99_s"] is None  # nothing ran to free anything
    assert res["monitor_cpu_share"] is not None
    assert res["samples_written"] == 12 * 16 * 4 and res["samples_dropped"] == 0
    assert res["sample_stream_len"] <= 8 * 16 * 4 + 100  # XTRIM MINID to the newest 8 policy versions
    assert len(res["redis_used_memory_series"]) >= 3 and res["redis_used_memory_bytes"] > 0


@pytest.mark.slow
def test_real_sessions_train_and_merge_into_the_lineage():
    res = bench("--workers", "2", timeout=600)
    assert res["session"] == "real" and res["policy"].startswith("micro")
    assert res["sessions_started"] >= 1 and res["sessions_failed"] == 0
    assert res["session_steps"] > 0 and res["lineage_head"] is not None and res["lineage_head"]["steps"] > 0


def test_renew_many_answers_each_lease_like_renew(redis_client):
    from tailspec.core import state
    from tailspec.core.state import SchedulerLeader
    from tailspec.scheduler.leases import DEPOSED, EXPIRED, RENEWED, REVOKED, STALE, Leases

    r, c = redis_client, "t-renew-many"
    lz = Leases(r, c)
    a = lz.acquire("n", 0, "x", ttl_s=5)
    b = lz.acquire("n", 1, "x", ttl_s=5)
    d = lz.acquire("n", 3, "x", ttl_s=5)
    lz.revoke("n", 1, b.token)
    got = lz.renew_many([("n", 0, a.token), ("n", 1, b.token), ("n", 2, 99), ("n", 3, d.token + 1)], 5.0,
                        require_heartbeat=False)
    assert got == [RENEWED, REVOKED, EXPIRED, STALE]
    one = [lz.renew("n", 0, a.token, 5.0, require_heartbeat=False), lz.renew("n", 3, d.token + 1, 5.0,
                                                                            require_heartbeat=False)]
    assert one == [got[0], got[3]]
    assert lz.renew_many([("n", 0, a.token)], 5.0, require_heartbeat=True) == [lz.renew("n", 0, a.token, 5.0)]
    # a lease granted under a leader epoch that no longer leads
    lead = lambda epoch: r.set(state.key(c, "leader"), state.encode(  # noqa: E731
        SchedulerLeader(epoch=epoch, holder="h", node="n", pid=1, since=0.0)))
    lead(1)
    e = lz.acquire("n", 4, "x", ttl_s=5, epoch=1)
    assert e is not None and lz.renew_many([("n", 4, e.token)], 5.0, require_heartbeat=False) == [RENEWED]
    lead(2)
    assert lz.renew_many([("n", 4, e.token)], 5.0, require_heartbeat=False) == [DEPOSED]
