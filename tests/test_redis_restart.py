"""A private redis-server with AOF survives SIGKILL + restart, and connections from core.redis_conn ride the
outage out: commands issued while it is down complete once it is back."""

import threading
import time

import pytest
from tailspec.core.redis_conn import connect

from tailspec.redis_server import RedisServerError, start_redis


def test_sigkill_restart_keeps_what_the_aof_synced_and_clients_ride_it_out():
    srv = start_redis(aof=True)
    try:
        r = connect(srv.url, outage_s=10)
        r.set("before", "1")
        r.xadd("s", {"data": "x"})
        time.sleep(1.5)  # appendfsync everysec: synced by now
        srv.kill()
        assert not srv.alive()
        restarted = threading.Timer(1.0, srv.restart)
        restarted.start()
        t0 = time.monotonic()
        assert r.get("before") == b"1"  # issued while the server is down; answered after the restart
        waited = time.monotonic() - t0
        restarted.join()
        assert 0.5 < waited < 10, waited
        assert r.xlen("s") == 1
        pusher = threading.Timer(0.3, lambda: connect(srv.url).rpush("q", "v"))
        pusher.start()
        assert r.blpop(["q"], timeout=5) == (b"q", b"v")
        pusher.join()
    finally:
        srv.stop()


def test_restart_refuses_a_running_server_and_the_outage_budget_is_finite():
    srv = start_redis()
    try:
        with pytest.raises(RedisServerError, match="still running"):
            srv.restart()
        srv.kill()
        import redis

        r = connect(srv.url, outage_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(redis.exceptions.ConnectionError):
            r.ping()
        assert time.monotonic() - t0 < 10
        with pytest.raises(ValueError, match="outage_s"):
            connect(srv.url, outage_s=-1)
    finally:
        srv.stop()
