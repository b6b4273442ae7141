"""A published phase change wakes the scheduler between ticks (scheduler/phase_wake.py): the unit on a real
redis-server, and the scheduler loop revoking a lent GPU long before its next tick would."""

from __future__ import annotations

import threading
import time

import redis
from tailspec.core import state
from tailspec.scheduler.phase_wake import PhaseWake
from test_scheduler_service import lend_two_gpus, make_cfg, running_sessions, wait_for


def test_wait_returns_on_a_publish_and_sleeps_out_its_delay_otherwise(redis_url, redis_client):
    ch = state.key("pw", "phase")
    w = PhaseWake(redis.Redis.from_url(redis_url), ch).start()
    try:
        assert w.subscribed.wait(5.0)
        t0 = time.monotonic()
        assert w.wait(0.3) is False  # nothing published
        assert time.monotonic() - t0 >= 0.29
        threading.Timer(0.1, lambda: redis_client.publish(ch, "train")).start()
        t0 = time.monotonic()
        assert w.wait(5.0) is True
        assert time.monotonic() - t0 < 2.0 and w.wakes == 1
        redis_client.publish(state.key("other", "phase"), "train")  # another cluster's phase: not ours
        assert w.wait(0.2) is False and w.wakes == 1
    finally:
        w.close()


def test_wait_without_redis_is_a_plain_sleep_and_a_stop_ends_it():
    stop = threading.Event()
    w = PhaseWake(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2), "x", stop).start()
    try:
        for _ in range(3):  # the listener's failed connections never hold up the loop's wait
            t0 = time.monotonic()
            assert w.wait(0.3) is False
            assert 0.29 <= time.monotonic() - t0 < 0.5
        assert not w.subscribed.is_set()
        stop.set()
        t0 = time.monotonic()
        assert w.wait(5.0) is False and time.monotonic() - t0 < 0.1
    finally:
        t0 = time.monotonic()
        w.close()
        assert time.monotonic() - t0 < 2.0


def test_phase_end_revokes_within_a_fraction_of_a_long_tick(redis_url, redis_client):
    """With a 4 s tick, the revocation at the phase change comes from the woken loop: without the wake its lag
    would be spread over the whole tick (a 0.4 s bound would hold by chance one time in ten)."""
    from tailspec.scheduler.client import TailspecClient
    from tailspec.scheduler.service import run_local

    cfg = make_cfg(redis_url, ttl=20.0)
    cfg.scheduler.tick_s = 4.0
    cfg.scheduler.leader_ttl_s = 15.0  # the lead outlives a tick
    cfg.scheduler.idle_window_s = 0.0
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), daemon=True)
    th.start()
    c = TailspecClient(redis_url, cluster=cfg.cluster.name, node=cfg.cluster.node)
    leases = state.key(cfg.cluster.name, "lease", node="*", gpu="*")
    try:
        lend_two_gpus(c)
        wait_for(lambda: running_sessions(redis_client, 2, cfg.cluster.name), 60, "two running sessions")
        time.sleep(0.2)  # off the tick that saw the sessions start
        c.set_phase("train", step=1)
        assert c.flush(5.0)
        t0 = time.monotonic()
        wait_for(lambda: redis_client.keys(leases) == [], 10, "leases revoked")
        assert time.monotonic() - t0 < 0.4, "the revocation waited for the tick"
    finally:
        c.close()
        stop.set()
        th.join(15)


def test_a_report_that_drains_a_worker_is_announced_once(redis_url, redis_client):
    """A drain is announced on the phase channel after the progress that says it; a keep-alive re-send, a report
    still generating or one outside a rollout is not a drain."""
    from tailspec.scheduler.client import TailspecClient

    cl = "drain-pub"
    sub = redis_client.pubsub()
    sub.subscribe(state.key(cl, "phase"))
    assert sub.get_message(timeout=5.0)["type"] == "subscribe"
    c = TailspecClient(redis_url, cluster=cl, node="node0", progress_ttl_s=0.6)

    def messages(wait_s: float) -> list[bytes]:
        out, deadline = [], time.monotonic() + wait_s
        while time.monotonic() < deadline:
            m = sub.get_message(timeout=0.05)
            if m is not None and m["type"] == "message":
                out.append(m["data"])
        return out

    try:
        c.set_phase("rollout", step=1)
        c.report_progress("w0", [0], active=3, finished=0, step=1)
        assert c.flush(5.0)
        assert messages(0.3) == [b"rollout"]
        c.report_progress("w0", [0], active=0, finished=3, step=1)
        assert c.flush(5.0)
        assert messages(0.3) == [b"drained"]
        # the writer re-sends the report before its key expires (a third of 0.6 s): not a new drain
        assert messages(0.8) == []
        assert c.sent["progress"] >= 3
        c.report_progress("w0", [0], active=0, finished=3, step=1, mem_released=True)  # memory given back: lendable now
        assert c.flush(5.0)
        assert messages(0.3) == [b"drained"]
        c.set_phase("train", step=1)
        c.report_progress("w0", [0], active=0, finished=3, phase="train", step=1)
        assert c.flush(5.0)
        assert messages(0.3) == [b"train"]
    finally:
        c.close()
        sub.close()


def test_newly_drained():
    from tailspec.core.state import Progress
    from tailspec.scheduler.client_writer import newly_drained

    def p(active, phase="rollout", step=1, released=None):
        return Progress(worker="w", node="n", gpus=[0], active=active, finished=0, phase=phase, step=step,
                        mem_released=released, ts=0.0)

    assert newly_drained(None, p(0)) and newly_drained(p(2), p(0)) and newly_drained(p(0, step=0), p(0))
    assert newly_drained(p(0, phase="train"), p(0)) and newly_drained(p(0), p(0, released=True))
    assert not newly_drained(p(0), p(0)) and not newly_drained(None, p(1)) and not newly_drained(p(2), p(0, "train"))


def test_a_drain_is_sampled_and_lent_within_a_fraction_of_a_long_sampling_period(redis_url, redis_client):
    """Simulated telemetry sampled every 10 s: the drained GPU's sample comes from the monitor the drain woke, so the
    lease follows within a second; without the wake the idle detector waits for the next sample on the grid (up
    to 10 s, under a second one time in ten)."""
    from tailspec.core.state import GpuState, GpuStatus
    from tailspec.scheduler.client import TailspecClient
    from tailspec.scheduler.service import run_local

    cfg = make_cfg(redis_url, cluster="drain-lend", ttl=20.0)
    cfg.scheduler.sample_period_s = 10.0
    cfg.scheduler.idle_window_s = 0.0
    cl = cfg.cluster.name
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), daemon=True)
    th.start()
    c = TailspecClient(redis_url, cluster=cl, node=cfg.cluster.node)
    lease0 = state.key(cl, "lease", node="node0", gpu=0)

    def status(gpu: int):
        st = state.get(redis_client, state.key(cl, "gpu_status", node="node0", gpu=gpu), GpuStatus)
        return None if st is None else st.state

    try:
        c.set_phase("rollout", step=1)
        for w in range(3):
            c.report_progress(f"w{w}", [w], active=3, finished=0, step=1)
        assert c.flush(5.0)
        wait_for(lambda: all(status(g) == GpuState.GENERATING for g in range(3)), 20, "three generating GPUs")
        assert redis_client.get(lease0) is None
        time.sleep(0.3)  # off the samples that the phase and the reports woke
        c.report_progress("w0", [0], active=0, finished=3, step=1)
        assert c.flush(5.0)
        t0 = time.monotonic()
        wait_for(lambda: redis_client.get(lease0) is not None, 10, "GPU 0 lent")
        assert time.monotonic() - t0 < 1.0, "the lend waited for the sampling grid"
    finally:
        c.close()
        stop.set()
        th.join(15)
