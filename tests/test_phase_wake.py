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
