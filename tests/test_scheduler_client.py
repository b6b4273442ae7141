"""tailspec.scheduler.client: what the RL framework calls, on a real redis-server, and with Redis gone."""

from __future__ import annotations

import time

import pytest
from tailspec.core import state
from tailspec.core.state import DrafterVersion, PhaseInfo, Progress, Sample
from tailspec.scheduler.client import TailspecClient
from tailspec.scheduler.scripted_rollout import run_scripted_rollout


def test_progress_phase_and_samples_reach_redis(redis_url, redis_client):
    c = TailspecClient(redis_url, cluster="t", node="n1", progress_ttl_s=3.0)
    try:
        c.set_phase("rollout", step=4, policy_version=4, policy_path="/ckpt/4")
        c.report_progress("w0", [0, 1], active=5, finished=3, total=8, tokens_done=120, tokens_per_s=300.0)
        n = c.submit_samples(
            [
                Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], reward=0.5, policy_version=4),
                {
                    "prompt_ids": [7],
                    "response_ids": [8],
                    "reward": -1.0,
                    "policy_version": 4,
                    "group_id": "g",
                },
            ]
        )
        assert n == 2
        assert c.flush(5)
        ph = state.get(redis_client, state.key("t", "phase"), PhaseInfo)
        assert (ph.phase, ph.step, ph.policy_version, ph.policy_path) == ("rollout", 4, 4, "/ckpt/4")
        p = state.get(redis_client, state.key("t", "progress", worker="w0"), Progress)
        assert (p.node, p.gpus, p.active, p.finished, p.step) == (
            "n1",
            [0, 1],
            5,
            3,
            4,
        )  # step from set_phase
        assert 0 < redis_client.pttl(state.key("t", "progress", worker="w0")) <= 3000
        assert redis_client.smembers(state.key("t", "workers")) == {b"w0"}
        got, _ = state.read_stream(redis_client, state.key("t", "samples"), Sample)
        assert [s.response_ids for _, s in got] == [[3, 4, 5], [8]]
    finally:
        c.close()


def test_progress_is_kept_alive_past_its_ttl(redis_url, redis_client):
    c = TailspecClient(redis_url, cluster="t", progress_ttl_s=0.3, refresh_s=0.05)
    try:
        c.report_progress("w0", [0], active=1, finished=0, step=1)
        time.sleep(1.0)  # > 3 TTLs without a new report
        p = state.get(redis_client, state.key("t", "progress", worker="w0"), Progress)
        assert p is not None and p.active == 1
    finally:
        c.close()


def test_bad_input_raises_clear_errors(redis_url):
    c = TailspecClient(redis_url, cluster="t")
    try:
        with pytest.raises(ValueError, match="active"):
            c.report_progress("w0", [0], active=-1, finished=0)
        with pytest.raises(ValueError, match="phase"):
            c.set_phase("generate", step=1)
        with pytest.raises(ValueError, match="reward"):
            c.submit_samples(
                [{"prompt_ids": [1], "response_ids": [2], "reward": "high", "policy_version": 0}]
            )
    finally:
        c.close()


def test_current_drafter_reads_the_promoted_version(redis_url, redis_client):
    v = DrafterVersion(version=3, path="/d/v3", policy_version=2, promoted=True, created_at=time.time())
    state.put(redis_client, state.key("t", "drafter_current"), v)
    c = TailspecClient(redis_url, cluster="t", refresh_s=0.05)
    try:
        assert c.current_drafter() == v
        v4 = v.model_copy(update={"version": 4, "path": "/d/v4"})
        state.put(redis_client, state.key("t", "drafter_current"), v4)
        c.report_progress("w", [0], active=0, finished=0)  # wakes the writer, which refreshes
        deadline = time.time() + 3
        while c.current_drafter() != v4 and time.time() < deadline:
            time.sleep(0.02)
        assert c.current_drafter() == v4
    finally:
        c.close()


def test_full_queue_drops_and_counts(redis_url, redis_client):
    c = TailspecClient("redis://127.0.0.1:1/0", cluster="t", queue_size=10, timeout_s=0.1)  # nothing listens
    try:
        s = {"prompt_ids": [1], "response_ids": [2], "reward": 1.0, "policy_version": 0}
        t0 = time.perf_counter()
        accepted = sum(c.submit_samples([s] * 5) for _ in range(10))
        assert time.perf_counter() - t0 < 0.5
        assert accepted <= 10 + 5  # the writer may have taken one batch off the queue before failing
        assert c.dropped["client_queue_full"] + c.dropped["redis_unavailable"] >= 50 - accepted
        assert c.dropped["client_queue_full"] >= 30
    finally:
        c.close(flush_s=0.1)


def test_slow_redis_never_stalls_the_caller(redis_url, redis_client):
    """A Redis that hangs (paused with CLIENT PAUSE) must not slow report_progress down."""
    c = TailspecClient(redis_url, cluster="t", timeout_s=0.3)
    try:
        c.report_progress("w0", [0], active=1, finished=0)
        assert c.flush(5)
        redis_client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        worst = 0.0
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            c.report_progress("w0", [0], active=2, finished=0)
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.01)
        # A call that waited on Redis would take at least the 0.3 s socket timeout; OS scheduling noise
        # on a loaded machine stays well below half of it.
        assert worst < 0.15, f"report_progress took {worst * 1000:.1f} ms while Redis was paused"
    finally:
        redis_client.execute_command("CLIENT", "UNPAUSE")
        c.close()


def test_simulated_rollout_ground_truth(redis_url, redis_client):
    res = run_scripted_rollout(
        redis_url,
        workers=3,
        steps=1,
        requests_per_worker=2,
        lengths=[10, 20, 5, 5, 40, 1],
        token_time_s=0.01,
        train_s=0.0,
        cluster="t",
    )
    st = res.steps[0]
    # worker i finishes with its longest request: 20, 5 and 40 tokens × 10 ms
    assert [round(st.drained_at[f"sim-worker{i}"] - st.started_at, 3) for i in range(3)] == [0.2, 0.05, 0.4]
    assert st.ended_at >= st.started_at + 0.4
    expect = sum(st.ended_at - t for t in st.drained_at.values())
    assert abs(res.idle_gpu_seconds - expect) < 1e-9 and res.idle_gpu_seconds > 0.3
    ph = state.get(redis_client, state.key("t", "phase"), PhaseInfo)
    assert ph.phase == "idle"
    p = state.get(redis_client, state.key("t", "progress", worker="sim-worker2"), Progress)
    assert p.gpus == [2] and p.active == 0 and p.phase == "train"
    with pytest.raises(ValueError, match="lengths"):
        run_scripted_rollout(redis_url, lengths=[0], cluster="t")


def test_simulated_cluster_fills_the_dashboard_keys(redis_url, redis_client):
    from tailspec.scheduler.scripted_rollout import run_scripted_cluster

    res = run_scripted_cluster(
        redis_url,
        workers=2,
        steps=1,
        cluster="t-simcluster",
        requests_per_worker=1,
        lengths=[20, 150],
        token_time_s=0.02,
        train_s=0.2,
        settle_s=1.2,
    )
    assert res.idle_gpu_seconds > 2.0  # worker 0 idles ~2.6 s while worker 1 runs its tail
    counters = {
        k.decode(): float(v) for k, v in redis_client.hgetall(state.key("t-simcluster", "counters")).items()
    }
    assert counters["sessions_started"] >= 1 and counters["lent_gpu_seconds"] > 0
    assert counters["sessions_stopped"] == counters["sessions_started"]
    for name in ("telemetry_history", "status_history", "events"):
        assert redis_client.xlen(state.key("t-simcluster", name)) > 0
    assert redis_client.get(state.key("t-simcluster", "gpu_status", node="node0", gpu=0)) is not None
    assert redis_client.scard(state.key("t-simcluster", "sessions")) >= 1


def test_sample_stream_keeps_the_newest_policy_versions(redis_url, redis_client):
    c = TailspecClient(redis_url, cluster="trim", samples_keep_versions=3)
    try:
        c.report_progress("w0", [0], active=1, finished=0)  # progress in the same write shifts the pipeline
        for v in range(7):
            c.submit_samples([Sample(prompt_ids=[1], response_ids=[2, v], reward=1.0, policy_version=v)
                              for _ in range(5)])
            assert c.flush(5)
        got, _ = state.read_stream(redis_client, state.key("trim", "samples"), Sample)
        assert sorted({s.policy_version for _, s in got}) == [4, 5, 6]
        assert len(got) == 15
    finally:
        c.close()
