"""The scheduler end to end in single-node mode: real redis-server, real scheduler loop, real session
processes (tailspec.scheduler.busy_sessions:busy_session), simulated GPU telemetry. Failure cases:
SIGKILL of the scheduler process and a stopped Redis while GPUs are lent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import Event, GpuState, GpuStatus, SessionInfo
from tailspec.scheduler.client import TailspecClient

ENTRY = "tailspec.scheduler.busy_sessions:busy_session"
CL = "t"  # this test's cluster name; unique per test so a straggling thread of another test cannot interfere


@pytest.fixture(autouse=True)
def _unique_cluster(request):
    global CL
    CL = "t-" + "".join(ch for ch in request.node.name if ch.isalnum())[-40:]
    yield


def make_cfg(url: str, cluster: str | None = None, ttl: float = 2.0, gpus: int = 3) -> TailspecConfig:
    cfg = TailspecConfig()
    cfg.cluster.name = cluster or CL
    cfg.cluster.redis_url = url
    cfg.scheduler.telemetry = "simulated"
    cfg.scheduler.simulated_gpus = gpus
    cfg.scheduler.session_entry = ENTRY
    cfg.scheduler.lease_ttl_s = ttl
    cfg.scheduler.session_startup_s = 0.0
    return cfg


def wait_for(pred, timeout: float, what: str, period: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def sessions(r, cluster=None) -> dict[str, SessionInfo]:
    out = {}
    cluster = cluster or CL
    for sid in r.smembers(state.key(cluster, "sessions")):
        info = state.get(r, state.key(cluster, "session", session_id=sid.decode()), SessionInfo)
        if info is not None:
            out[sid.decode()] = info
    return out


def running_sessions(r, n: int, cluster=None) -> dict[str, SessionInfo]:
    s = {k: v for k, v in sessions(r, cluster).items() if v.status == "running" and v.step >= 2}
    return s if len(s) >= n else {}


def lend_two_gpus(c: TailspecClient) -> None:
    """GPU 1's worker keeps generating (the tail); GPUs 0 and 2 drained → lendable."""
    c.set_phase("rollout", step=1)
    c.report_progress("w0", [0], active=0, finished=8, step=1)
    c.report_progress("w1", [1], active=3, finished=5, step=1)
    c.report_progress("w2", [2], active=0, finished=8, step=1)


def test_local_scheduler_lends_drained_gpus_and_reclaims_them_at_phase_end(redis_url, redis_client):
    from tailspec.scheduler.service import run_local

    cfg = make_cfg(redis_url)
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), daemon=True)
    th.start()
    c = TailspecClient(redis_url, cluster=CL, node=cfg.cluster.node)
    try:
        lend_two_gpus(c)
        live = wait_for(lambda: running_sessions(redis_client, 2), 30, "two running sessions")
        assert sorted(s.gpu for s in live.values()) == [0, 2]  # never GPU 1: its worker generates
        st1 = state.get(redis_client, state.key(CL, "gpu_status", node="node0", gpu=1), GpuStatus)
        assert st1.state == GpuState.GENERATING
        for s in live.values():
            st = state.get(redis_client, state.key(CL, "gpu_status", node="node0", gpu=s.gpu), GpuStatus)
            assert st.state == GpuState.LENT and st.session_id == s.session_id
            lease = state.get(redis_client, state.key(CL, "lease", node="node0", gpu=s.gpu), state.Lease)
            assert lease.token == s.lease_token
        # the phase ends: every session stops (by its own lease check) well within the deadline
        t_end = time.time()
        c.set_phase("train", step=1)
        done = wait_for(
            lambda: (
                all(v.status in ("stopped", "failed") for v in sessions(redis_client).values())
                and sessions(redis_client)
            ),
            10,
            "sessions stopped",
        )
        for s in sessions(redis_client).values():
            assert s.status == "stopped", s  # busy_session fails if CUDA_VISIBLE_DEVICES != its GPU
            assert s.stop_reason == "revoked"
            assert s.stopped_at - t_end < cfg.scheduler.stop_deadline_s + 0.5
        assert done
        wait_for(lambda: redis_client.keys(state.key(CL, "lease", node="*", gpu="*")) == [], 5, "leases gone")
        counters = {k.decode(): float(v) for k, v in redis_client.hgetall(state.key(CL, "counters")).items()}
        assert counters["sessions_started"] == 2 and counters["sessions_preempted"] == 2
        wait_for(
            lambda: float(redis_client.hget(state.key(CL, "counters"), "sessions_stopped") or 0) == 2,
            5,
            "sessions_stopped counter",
        )
        assert 0 < counters["lent_gpu_seconds"] <= counters["idle_gpu_seconds"]
        # the dashboards' timeline: GPU 0 went drained → lent → reclaiming
        hist, _ = state.read_stream(redis_client, state.key(CL, "status_history"), GpuStatus)
        seq = [s.state for _, s in hist if s.gpu == 0]
        i = seq.index(GpuState.DRAINED)
        assert seq[i : i + 3] == [GpuState.DRAINED, GpuState.LENT, GpuState.RECLAIMING]
        events, _ = state.read_stream(redis_client, state.key(CL, "events"), Event)
        kinds = [e.kind for _, e in events]
        for k in ("gpu_idle", "lease_granted", "session_started", "lease_revoked", "session_stopped"):
            assert k in kinds
        tel = state.get(redis_client, state.key(CL, "telemetry", node="node0", gpu=1), state.GpuTelemetry)
        assert tel.simulated and tel.util > 50  # GPU 1 generating
        assert redis_client.xlen(state.key(CL, "telemetry_history")) > 0
    finally:
        c.close()
        stop.set()
        th.join(10)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_scheduler_sessions_stop_within_one_ttl(redis_url, redis_client, tmp_path):
    ttl = 2.0
    cmd = [
        sys.executable,
        "-m",
        "tailspec.cli",
        "scheduler",
        "run",
        "--redis",
        redis_url,
        "--session-logs",
        str(tmp_path),
        "--set",
        f"cluster.name={CL}",
        "--set",
        "scheduler.telemetry=simulated",
        "--set",
        "scheduler.simulated_gpus=3",
        "--set",
        f"scheduler.session_entry={ENTRY}",
        "--set",
        f"scheduler.lease_ttl_s={ttl}",
        "--set",
        "scheduler.session_startup_s=0",
    ]
    sched = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    c = TailspecClient(redis_url, cluster=CL, node="node0")
    try:
        wait_for(lambda: redis_client.get(state.key(CL, "scheduler_heartbeat")), 30, "scheduler heartbeat")
        lend_two_gpus(c)
        live = wait_for(lambda: running_sessions(redis_client, 2), 30, "two running sessions")
        pids = _children(sched.pid)
        assert len(pids) == 2
        t_kill = time.time()
        sched.send_signal(signal.SIGKILL)
        sched.wait(5)
        wait_for(lambda: not any(_alive(p) for p in pids), 3 * ttl, "sessions to exit")
        t_gone = time.time()
        for sid in live:
            info = state.get(redis_client, state.key(CL, "session", session_id=sid), SessionInfo)
            assert info.status == "stopped" and info.stop_reason == "scheduler heartbeat lost"
            assert info.stopped_at - t_kill <= ttl, (
                f"{sid} stopped {info.stopped_at - t_kill:.2f}s after SIGKILL"
            )
        print(f"sessions gone {t_gone - t_kill:.2f}s after SIGKILL (ttl {ttl}s)")
    finally:
        c.close()
        if sched.poll() is None:
            sched.kill()
        for p in _children(sched.pid):
            os.kill(p, signal.SIGKILL)


def test_redis_stop_sessions_stop_within_one_ttl_and_client_stays_fast(tmp_path):
    from tailspec.scheduler.service import run_local

    from tailspec.redis_server import start_redis

    ttl = 2.0
    server = start_redis()
    r = redis.Redis.from_url(server.url)
    cfg = make_cfg(server.url, ttl=ttl)
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), kwargs={"log_dir": str(tmp_path)}, daemon=True)
    th.start()
    c = TailspecClient(server.url, cluster=CL, node="node0", timeout_s=0.5)
    try:
        lend_two_gpus(c)
        wait_for(lambda: running_sessions(r, 2), 30, "two running sessions")
        pids = [
            p
            for p in _children(os.getpid())
            if "tailspec.scheduler.session_process" in open(f"/proc/{p}/cmdline").read()
        ]
        assert len(pids) == 2
        t_stop = time.time()
        server.stop()
        # the client keeps answering at once while Redis is gone
        worst = 0.0
        for i in range(200):
            t0 = time.perf_counter()
            c.report_progress("w1", [1], active=2, finished=6, step=1)
            c.submit_samples(
                [{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0, "policy_version": 0}]
            )
            c.current_drafter()
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.002)
        # waiting on Redis would cost at least the 0.5 s socket timeout; scheduling noise stays far below
        assert worst < 0.25, f"a client call took {worst * 1000:.1f} ms with Redis down"
        wait_for(lambda: not any(_alive(p) for p in pids), 3 * ttl, "sessions to exit")
        gone = time.time() - t_stop
        assert gone <= ttl + 0.25, f"sessions took {gone:.2f}s to stop after Redis went away (ttl {ttl}s)"
        wait_for(
            lambda: c.dropped["redis_unavailable"] + c.dropped["client_queue_full"] > 0, 5, "counted drops"
        )
        print(
            f"sessions gone {gone:.2f}s after Redis stopped; worst client call {worst * 1000:.2f} ms; "
            f"drops {dict(c.dropped)}"
        )
    finally:
        stop.set()
        th.join(15)
        c.close(flush_s=0.1)
        server.stop()
        for p in _children(os.getpid()):
            try:
                if "tailspec.scheduler.session_process" in open(f"/proc/{p}/cmdline").read():
                    os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_take_over_revokes_leases_granted_outside_any_leader_epoch(redis_url, redis_client):
    """A lease without an epoch is renewable under any leader: the new leader revokes it at its take-over, as
    nothing else would end it (leases of earlier epochs are left to expire: tests/test_scheduler_leader.py)."""
    from tailspec.scheduler.dispatch import LocalDispatcher
    from tailspec.scheduler.leases import Leases
    from tailspec.scheduler.service import Scheduler

    ls = Leases(redis_client, CL)
    old = ls.acquire("node0", 1, "scheduler@old", ttl_s=30)
    s = Scheduler(make_cfg(redis_url), redis_client, LocalDispatcher(ENTRY))
    s.tick()
    assert s.leading
    assert ls.current("node0", 1) is None
    assert ls.renew("node0", 1, old.token, 30, require_heartbeat=False) < 0
    events, _ = state.read_stream(redis_client, state.key(CL, "events"), Event)
    elected = [e for _, e in events if e.kind == "leader_elected"]
    assert len(elected) == 1 and elected[0].detail["revoked"] == 1 and elected[0].detail["epoch"] == s.epoch


def test_bad_payloads_are_skipped_not_fatal(redis_url, redis_client):
    from tailspec.scheduler.dispatch import LocalDispatcher
    from tailspec.scheduler.service import Scheduler

    s = Scheduler(make_cfg(redis_url), redis_client, LocalDispatcher(ENTRY))
    redis_client.set(state.key(CL, "phase"), b"\x80\x04pickle")
    redis_client.sadd(state.key(CL, "workers"), "w0", "w1")
    redis_client.set(state.key(CL, "progress", worker="w0"), b'{"worker": "w0"}')
    redis_client.sadd(state.key(CL, "gpus"), "node0:0", "garbage")
    redis_client.set(state.key(CL, "gpu_health", node="node0"), b"not json")
    s.tick()
    s.tick()
    assert s.bad_payloads >= 6
    assert redis_client.get(state.key(CL, "scheduler_heartbeat")) is not None


def test_only_drained_gpus_samples_are_read_and_a_malformed_one_is_not_lent(redis_url, redis_client):
    """The scheduler reads a GPU's sample only while its worker reports it drained: a malformed sample of a generating
    GPU is never decoded, a drained GPU's is reported at every tick and the GPU stays unknown, never lent."""
    from tailspec.scheduler.dispatch import LocalDispatcher
    from tailspec.scheduler.monitor import publish_samples
    from tailspec.scheduler.service import Scheduler

    s = Scheduler(make_cfg(redis_url), redis_client, LocalDispatcher(ENTRY))
    now = time.time()
    state.put(redis_client, state.key(CL, "phase"), state.PhaseInfo(phase="rollout", step=1, started_at=now - 30))
    for g, active in ((0, 0), (1, 3)):
        redis_client.sadd(state.key(CL, "workers"), f"w{g}")
        state.put(redis_client, state.key(CL, "progress", worker=f"w{g}"),
                  state.Progress(worker=f"w{g}", node="node0", gpus=[g], active=active, finished=5,
                                 phase="rollout", step=1, ts=now))
    publish_samples(redis_client, CL, [state.GpuTelemetry(node="node0", gpu=g, util=0.0, mem_used=0,
                                                          mem_total=80 << 30, simulated=True, ts=now)
                                       for g in (0, 1)])
    for g in (0, 1):
        redis_client.set(state.key(CL, "telemetry", node="node0", gpu=g), b"not json")
    for _ in range(3):
        s.tick()
    assert s.bad_payloads == 3  # GPU 0's sample, once per tick; GPU 1's is never read
    assert s.detector.machines[("node0", 0)].state == GpuState.UNKNOWN
    assert s.detector.machines[("node0", 1)].state == GpuState.GENERATING
    assert not redis_client.keys(state.key(CL, "lease", node="*", gpu="*"))


def test_failing_session_entry_is_recorded_and_not_restarted_in_a_loop(redis_url, redis_client):
    from tailspec.scheduler.lessor import FAILED_BACKOFF_S
    from tailspec.scheduler.service import run_local

    cfg = make_cfg(redis_url)
    cfg.scheduler.session_entry = "tailspec.scheduler.busy_sessions:no_such_session"
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), daemon=True)
    th.start()
    c = TailspecClient(redis_url, cluster=CL, node="node0")
    try:
        c.set_phase("rollout", step=1)
        c.report_progress("w0", [0], active=0, finished=8, step=1)
        c.report_progress("w1", [1], active=3, finished=5, step=1)
        first = wait_for(
            lambda: [s for s in sessions(redis_client).values() if s.status == "failed"], 30, "failure"
        )
        assert "has no attribute 'no_such_session'" in first[0].stop_reason
        time.sleep(min(3.0, FAILED_BACKOFF_S - 1))
        assert len(sessions(redis_client)) == 1  # backed off instead of relaunching every tick
        events, _ = state.read_stream(redis_client, state.key(CL, "events"), Event)
        assert any(e.kind == "session_failed" for _, e in events)
    finally:
        c.close()
        stop.set()
        th.join(10)
