"""Ray mode on a local Ray cluster with 4 fake GPUs: sessions are actors placed on the lent GPU ids
(CUDA_VISIBLE_DEVICES) and node, stopped on revoke; `tailspec attach` / `detach` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import SessionInfo
from tailspec.scheduler.client import TailspecClient

ENTRY = "tailspec.scheduler.busy_sessions:busy_session"

pytestmark = pytest.mark.slow


def wait_for(pred, timeout, what, period=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def sessions(r, cluster) -> dict[str, SessionInfo]:
    out = {}
    for sid in r.smembers(state.key(cluster, "sessions")):
        info = state.get(r, state.key(cluster, "session", session_id=sid.decode()), SessionInfo)
        if info is not None:
            out[sid.decode()] = info
    return out


def test_ray_sessions_run_on_the_lent_gpus_and_stop_on_revoke(ray_cluster, redis_url, redis_client):
    ray = ray_cluster
    from tailspec.scheduler.attach import NAMESPACE, attach, detach, node_name, scheduler_actor_name

    cluster = "rayt"
    cfg = TailspecConfig()
    cfg.cluster.name = cluster
    cfg.scheduler.mode = "ray"
    cfg.scheduler.telemetry = "simulated"
    cfg.scheduler.session_entry = ENTRY
    cfg.scheduler.session_startup_s = 0.0
    info = attach(cfg, redis_url, address=None)
    node_id = ray.get_runtime_context().get_node_id()
    node = node_name(node_id)
    assert [t["node"] for t in info["telemetry"]] == [node]
    assert info["telemetry"][0]["gpus"] == [0, 1, 2, 3]  # from the node's GPU resource
    c = TailspecClient(redis_url, cluster=cluster, node=node)
    try:
        c.set_phase("rollout", step=1)
        for g in range(4):
            c.report_progress(f"w{g}", [g], active=0 if g in (1, 3) else 4, finished=4, step=1)
        live = wait_for(
            lambda: (
                {
                    k: v
                    for k, v in sessions(redis_client, cluster).items()
                    if v.status == "running" and v.step > 0
                }
                if len(
                    [
                        v
                        for v in sessions(redis_client, cluster).values()
                        if v.status == "running" and v.step > 0
                    ]
                )
                == 2
                else None
            ),
            90,
            "two running session actors",
        )
        assert sorted(v.gpu for v in live.values()) == [1, 3]
        sched = ray.get_actor(scheduler_actor_name(cluster), namespace=NAMESPACE)
        where = ray.get(sched.where.remote(), timeout=60)
        assert set(where) == set(live)
        for sid, w in where.items():
            assert w["cuda_visible_devices"] == str(live[sid].gpu)
            assert w["node_id"] == node_id
        # Ray's accounting is untouched: the GPUs stay the RL job's
        assert ray.available_resources().get("GPU", 0) == 4
        # worker 1 gets new requests: GPU 1's session is revoked, GPU 3's keeps running
        c.report_progress("w1", [1], active=2, finished=4, step=1)
        s1 = next(k for k, v in live.items() if v.gpu == 1)
        s3 = next(k for k, v in live.items() if v.gpu == 3)
        wait_for(
            lambda: sessions(redis_client, cluster)[s1].status == "stopped", 30, "GPU 1's session to stop"
        )
        assert sessions(redis_client, cluster)[s1].stop_reason == "revoked"
        assert sessions(redis_client, cluster)[s3].status == "running"
        c.set_phase("train", step=1)
        wait_for(
            lambda: sessions(redis_client, cluster)[s3].status == "stopped", 30, "GPU 3's session to stop"
        )
        wait_for(lambda: ray.get(sched.ping.remote())["live"] == [], 30, "scheduler to forget its sessions")
    finally:
        c.close()
        removed = detach(cfg, address=None)
    assert scheduler_actor_name(cluster) in removed and len(removed) == 2
    with pytest.raises(ValueError):
        ray.get_actor(scheduler_actor_name(cluster), namespace=NAMESPACE)


def test_cli_attach_and_detach_against_a_running_cluster(ray_cluster, redis_url, redis_client):
    ray = ray_cluster
    from tailspec.scheduler.attach import NAMESPACE, scheduler_actor_name

    address = "auto"  # finds the cluster this test process started
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    base = ["--set", "cluster.name=raycli", "--set", "scheduler.telemetry=simulated"]
    p = subprocess.run(
        [sys.executable, "-m", "tailspec.cli", "attach", "--address", address, "--redis", redis_url, *base],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SIMULATED telemetry" in p.stdout
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["scheduler"] == scheduler_actor_name("raycli")
    # the detached actors outlive the attaching process and keep the cluster state fresh
    ray.get_actor(scheduler_actor_name("raycli"), namespace=NAMESPACE)
    wait_for(lambda: redis_client.get(state.key("raycli", "scheduler_heartbeat")), 60, "scheduler heartbeat")
    wait_for(lambda: redis_client.scard(state.key("raycli", "gpus")) == 4, 60, "telemetry of 4 GPUs")
    p = subprocess.run(
        [sys.executable, "-m", "tailspec.cli", "detach", "--address", address, *base],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "removed 2 actors" in p.stdout
    with pytest.raises(ValueError):
        ray.get_actor(scheduler_actor_name("raycli"), namespace=NAMESPACE)
    assert redis_client.get(state.key("raycli", "scheduler_heartbeat")) is None
