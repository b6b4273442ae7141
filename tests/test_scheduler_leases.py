"""Fenced leases on a real redis-server: expiry, fencing, revoke, renew under load, one holder per GPU."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tailspec.core import state
from tailspec.scheduler import leases as L
from tailspec.scheduler.leases import Leases
from tailspec.scheduler.session_process import SessionContext


def _heartbeat(r, cluster="t", px=60_000):
    r.set(state.key(cluster, "scheduler_heartbeat"), "1", px=px)


def test_acquire_is_exclusive_and_tokens_increase(redis_client):
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 0, "a", ttl_s=5)
    assert a is not None and a.token >= 1
    assert ls.acquire("n0", 0, "b", ttl_s=5) is None  # held
    b = ls.acquire("n0", 1, "b", ttl_s=5)  # another GPU is free
    assert b is not None and b.token > a.token
    assert ls.current("n0", 0).holder == "a"
    assert redis_client.pttl(state.key("t", "lease", node="n0", gpu=0)) > 4000


def test_lease_expires_and_then_can_be_taken(redis_client):
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 0, "a", ttl_s=0.15)
    assert a is not None
    time.sleep(0.3)
    assert ls.current("n0", 0) is None
    b = ls.acquire("n0", 0, "b", ttl_s=5)
    assert b is not None and b.token > a.token
    assert ls.renew("n0", 0, a.token, 5, require_heartbeat=False) == L.STALE


def test_paused_holder_cannot_renew_or_write_after_expiry(redis_client):
    """The fencing scenario: A pauses past its TTL, B gets the GPU, A wakes up with its old token."""
    _heartbeat(redis_client)
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 0, "a", ttl_s=0.2)
    assert ls.renew("n0", 0, a.token, 0.2) == L.RENEWED
    out = state.key("t", "session", session_id="x")
    assert ls.fenced_set("n0", 0, a.token, out, b"from-a")
    time.sleep(0.35)  # A is "paused" (GC, swap, SIGSTOP)
    assert ls.renew("n0", 0, a.token, 0.2) == L.EXPIRED
    b = ls.acquire("n0", 0, "b", ttl_s=5)
    assert b is not None
    assert ls.renew("n0", 0, a.token, 5) == L.STALE
    assert not ls.fenced_set("n0", 0, a.token, out, b"late-a")
    assert ls.fenced_set("n0", 0, b.token, out, b"from-b")
    assert redis_client.get(out) == b"from-b"
    assert ls.current("n0", 0).token == b.token  # A's renew attempt did not touch B's lease


def test_revoke_flags_token_and_deletes_lease(redis_client):
    _heartbeat(redis_client)
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 0, "a", ttl_s=5)
    assert ls.revoke("n0", 0, a.token)
    assert ls.current("n0", 0) is None
    assert ls.renew("n0", 0, a.token, 5) == L.REVOKED
    # A new holder is not affected by the old token's revoke flag.
    b = ls.acquire("n0", 0, "b", ttl_s=5)
    assert ls.renew("n0", 0, b.token, 5) == L.RENEWED
    # Revoking a stale token leaves the current lease alone.
    assert not ls.revoke("n0", 0, a.token)
    assert ls.current("n0", 0).token == b.token
    # A flagged token whose lease still exists reports REVOKED.
    redis_client.set(state.key("t", "revoke", node="n0", gpu=0), str(b.token))
    assert ls.renew("n0", 0, b.token, 5) == L.REVOKED


def test_renew_requires_scheduler_heartbeat(redis_client):
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 0, "a", ttl_s=5)
    assert ls.renew("n0", 0, a.token, 5) == L.NO_SCHEDULER
    _heartbeat(redis_client)
    assert ls.renew("n0", 0, a.token, 5) == L.RENEWED


def test_renew_under_load_keeps_the_lease(redis_client, redis_url):
    """A holder renewing every 20 ms keeps a 0.3 s lease for 1.5 s while other clients hammer Redis
    with competing acquires and bulk writes."""
    import redis

    _heartbeat(redis_client)
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 0, "a", ttl_s=0.3)
    stop = threading.Event()
    stolen = []

    def hammer(i):
        r = redis.Redis.from_url(redis_url)
        lx = Leases(r, "t")
        blob = b"x" * 50_000
        while not stop.is_set():
            if lx.acquire("n0", 0, f"thief{i}", ttl_s=5) is not None:
                stolen.append(i)
            r.set(f"load:{i}", blob)
            r.xadd("load-stream", {"d": blob[:1000]}, maxlen=1000)
        r.close()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    codes = []
    t_end = time.monotonic() + 1.5
    try:
        while time.monotonic() < t_end:
            codes.append(ls.renew("n0", 0, a.token, 0.3))
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(codes) > 20
    assert set(codes) == {L.RENEWED}
    assert stolen == []
    assert ls.current("n0", 0).token == a.token


def test_session_context_round_trip_and_should_continue(redis_client, redis_url):
    _heartbeat(redis_client)
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 2, "s", ttl_s=1)
    ctx = SessionContext(
        session_id="s1",
        node="n0",
        gpu=2,
        lease_token=a.token,
        redis_url=redis_url,
        cluster="t",
        config={"x": 1},
        lease_ttl_s=1,
    )
    ctx2 = SessionContext.from_json(ctx.to_json())
    assert ctx2.to_json() == ctx.to_json() and ctx2.gpu == 2
    with pytest.raises(ValueError, match="unknown fields"):
        SessionContext.from_json('{"session_id": "s", "bogus": 1}')
    with pytest.raises(ValueError, match="not valid JSON"):
        SessionContext.from_json("\x80pickle")
    assert ctx2.should_continue()
    assert ctx2.phase() is None
    state.put(
        redis_client,
        state.key("t", "phase"),
        state.PhaseInfo(phase="rollout", step=2, started_at=0, policy_version=2, policy_path="/p/2"),
    )
    assert ctx2.phase().policy_path == "/p/2"
    from tailspec.core.config import TailspecConfig

    cfg = TailspecConfig()
    cfg.scheduler.lease_ttl_s = 7.0
    ctx3 = SessionContext.from_json(
        SessionContext(
            session_id="s",
            node="n0",
            gpu=0,
            lease_token=1,
            redis_url=redis_url,
            cluster="t",
            config=cfg.model_dump(mode="json"),
        ).to_json()
    )
    assert ctx3.tailspec_config() == cfg
    assert ctx2.report(3, loss=0.5, tokens=10)
    info = state.get(redis_client, state.key("t", "session", session_id="s1"), state.SessionInfo)
    assert info.step == 3 and info.status == "running"
    time.sleep(1.2)  # past the grant's TTL: the renewal thread kept the lease
    assert ctx2.should_continue() and ctx2.keeper.renewals >= 2
    ls.revoke("n0", 2, a.token)
    assert ctx2.keeper.wait_stopped(1.0)  # pushed, not polled: well inside a renewal period (0.25 s)
    assert not ctx2.should_continue()
    assert ctx2.stop_reason == "revoked" and ctx2.keeper.pushed
    assert not ctx2.should_continue()  # sticky
    assert not ctx2.report(4)  # not sent once the lease is gone
    assert not ctx2.leases.fenced_set("n0", 2, a.token, "x", "1")  # and Redis would refuse it
    ctx2.close()


def test_should_continue_stops_within_ttl_when_redis_is_unreachable():
    ctx = SessionContext(
        session_id="s",
        node="n0",
        gpu=0,
        lease_token=1,
        redis_url="redis://127.0.0.1:1/0",
        cluster="t",
        lease_ttl_s=0.5,
    )
    t0 = time.time()
    while ctx.should_continue():
        assert time.time() - t0 < 0.5
        time.sleep(0.01)
    assert "redis unreachable" in ctx.stop_reason
    assert time.time() - ctx.started_at <= 0.5
    ctx.close()


# -- property: at most one holder per GPU, whatever the interleaving ---------------------------------
_ops = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "renew", "revoke", "release", "expire"]),
        st.integers(0, 2),  # holder
        st.integers(0, 1),
    ),  # gpu
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_property_at_most_one_holder_per_gpu(redis_client, ops):
    redis_client.flushall()
    _heartbeat(redis_client)
    ls = Leases(redis_client, "p")
    redis_client.set(state.key("p", "scheduler_heartbeat"), "1", px=60_000)
    tokens: dict[tuple[int, int], int] = {}  # (holder, gpu) → token it believes it holds
    last_token = 0
    for op, h, g in ops:
        if op == "acquire":
            lease = ls.acquire("n", g, f"h{h}", ttl_s=30)
            if lease is not None:
                assert lease.token > last_token  # strictly increasing fencing tokens
                last_token = lease.token
                tokens[(h, g)] = lease.token
        elif op == "renew" and (h, g) in tokens:
            ls.renew("n", g, tokens[(h, g)], 30)
        elif op == "revoke" and (h, g) in tokens:
            ls.revoke("n", g, tokens[(h, g)])
        elif op == "release" and (h, g) in tokens:
            ls.release("n", g, tokens[(h, g)])
        elif op == "expire":
            redis_client.delete(state.key("p", "lease", node="n", gpu=g))
        # Invariant: per GPU, at most one believed holder can still renew, and it is the lease's token.
        for gpu in (0, 1):
            cur = ls.current("n", gpu)
            ok = [
                hh
                for (hh, gg), tok in tokens.items()
                if gg == gpu and ls.renew("n", gpu, tok, 30) == L.RENEWED
            ]
            assert len(ok) <= 1
            if ok:
                assert cur is not None and cur.token == tokens[(ok[0], gpu)]


def test_sigstopped_session_process_wakes_after_expiry_and_stops_without_writing(
    redis_client, redis_url, tmp_path
):
    """A real session process is paused (SIGSTOP) past its lease TTL; another holder takes the GPU; when
    the paused process resumes, its writes are refused and it stops, on its lease clock or the stale token."""
    import os
    import signal

    from tailspec.scheduler.dispatch import LocalDispatcher

    _heartbeat(redis_client)
    ls = Leases(redis_client, "t")
    a = ls.acquire("n0", 0, "scheduler", ttl_s=30)  # covers the start-up; the session renews with 0.5 s
    ctx = SessionContext(
        session_id="paused",
        node="n0",
        gpu=0,
        lease_token=a.token,
        redis_url=redis_url,
        cluster="t",
        lease_ttl_s=0.5,
    )
    d = LocalDispatcher("tailspec.scheduler.busy_sessions:busy_session", log_dir=str(tmp_path))
    d.start(ctx)
    key = state.key("t", "session", session_id="paused")

    def step():
        info = state.get(redis_client, key, state.SessionInfo)
        return info.step if info else 0

    deadline = time.monotonic() + 30
    while step() < 3:
        assert time.monotonic() < deadline, "session did not start"
        time.sleep(0.02)
    pid = d.pid("paused")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.1)
        frozen = step()
        time.sleep(0.8)  # past the TTL: the lease expires while the holder sleeps
        b = ls.acquire("n0", 0, "other", ttl_s=30)
        assert b is not None and b.token > a.token
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while "paused" not in d.poll():
        assert time.monotonic() < deadline, "paused session did not stop after waking"
        time.sleep(0.02)
    info = state.get(redis_client, key, state.SessionInfo)
    # whichever it meets first on waking: its own lease clock (run out while it slept) or its renewal's answer
    assert info.status == "stopped" and info.stop_reason in ("lease renewal late", "stale fencing token")
    assert info.step == frozen  # its post-wake progress report was refused by the fence
    assert ls.current("n0", 0).token == b.token  # the new holder's lease is untouched
