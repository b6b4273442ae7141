"""A session's lease kept off its step path (scheduler/lease_keeper.py): a renewal thread keeps it, a pushed
revocation ends it, `should_continue()` reads a local flag; a session stops within one layer of a revocation and
stops writing when its renewals stop."""

from __future__ import annotations

import threading
import time

from tailspec.core import state
from tailspec.scheduler.leases import Leases
from tailspec.scheduler.session_process import SessionContext


def _ctx(redis_url: str, token: int, gpu: int = 0, ttl: float = 30.0, cluster: str = "k", **kw) -> SessionContext:
    return SessionContext(session_id=f"s{gpu}", node="n0", gpu=gpu, lease_token=token, redis_url=redis_url,
                          cluster=cluster, lease_ttl_s=ttl, **{"require_heartbeat": False, **kw})


def test_the_thread_keeps_the_lease_without_any_call(redis_client, redis_url):
    ls = Leases(redis_client, "k")
    lease = ls.acquire("n0", 0, "s", ttl_s=0.6)
    ctx = _ctx(redis_url, lease.token, ttl=0.6)
    ctx.start_renewals()
    try:
        time.sleep(1.5)  # two and a half TTLs, no should_continue()
        assert redis_client.pttl(state.key("k", "lease", node="n0", gpu=0)) > 0
        assert ctx.should_continue() and ctx.keeper.renewals >= 4
    finally:
        ctx.close()


def test_should_continue_is_a_local_read(redis_client, redis_url):
    """20,000 checks, as a session makes before every layer: no Redis command beyond the thread's renewals."""
    ls = Leases(redis_client, "k")
    lease = ls.acquire("n0", 0, "s", ttl_s=30)
    ctx = _ctx(redis_url, lease.token)
    assert ctx.should_continue()  # starts the thread
    time.sleep(0.2)  # its subscription and first renewal are done
    before = redis_client.info("commandstats")
    t0 = time.perf_counter()
    for _ in range(20_000):
        assert ctx.should_continue()
    spent = time.perf_counter() - t0
    after = redis_client.info("commandstats")
    try:
        calls = {k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in after}
        scripts = calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0)
        assert scripts <= 1, calls  # at most one renewal fell in the window (every 7.5 s at this TTL)
        assert spent < 1.0, spent  # tens of ns each; generous for a loaded machine
    finally:
        ctx.close()


def test_a_revocation_is_pushed(redis_client, redis_url):
    """Revoked by the scheduler's bulk script, both sessions see it at once, long before a renewal would (every
    7.5 s here); another GPU's revocation and a stale token's are not theirs."""
    ls = Leases(redis_client, "k")
    a, b, c = (ls.acquire("n0", g, "s", ttl_s=30) for g in range(3))
    ctxs = [_ctx(redis_url, x.token, gpu=g) for g, x in enumerate((a, b, c))]
    for ctx in ctxs:
        ctx.start_renewals()
    try:
        time.sleep(0.3)  # subscribed
        redis_client.publish(ls.revoke_channel("n0", 2), str(c.token + 100))  # not its token
        pipe = redis_client.pipeline(transaction=False)
        ls.revoke_many([("n0", 0, a.token), ("n0", 1, b.token)], 60.0, None, pipe)
        t0 = time.monotonic()
        pipe.execute()
        for ctx in ctxs[:2]:
            assert ctx.keeper.wait_stopped(1.0)
        assert time.monotonic() - t0 < 1.0
        for ctx in ctxs[:2]:
            assert not ctx.should_continue() and ctx.stop_reason == "revoked" and ctx.keeper.pushed
        time.sleep(0.1)
        assert ctxs[2].should_continue()
    finally:
        for ctx in ctxs:
            ctx.close()


def test_a_lost_scheduler_heartbeat_stops_the_session_at_its_next_renewal(redis_client, redis_url):
    ls = Leases(redis_client, "k")
    redis_client.set(state.key("k", "scheduler_heartbeat"), "1", px=60_000)
    lease = ls.acquire("n0", 0, "s", ttl_s=0.8)
    ctx = _ctx(redis_url, lease.token, ttl=0.8, require_heartbeat=True)
    ctx.start_renewals()
    try:
        time.sleep(0.3)
        assert ctx.should_continue()
        redis_client.delete(state.key("k", "scheduler_heartbeat"))
        assert ctx.keeper.wait_stopped(0.6)  # a renewal every 0.2 s
        assert not ctx.should_continue() and ctx.stop_reason == "scheduler heartbeat lost"
    finally:
        ctx.close()


def test_a_session_stops_within_one_layer_of_a_revocation(redis_client, redis_url, tmp_path):
    """The lease is revoked while the teacher's second decoder layer runs (its third step's forward); the layer
    takes as long as the push takes to arrive (standing for a layer's work). The third layer never runs, the
    step in flight leaves no update, and the session stops on `Preempted` having trained two steps."""
    from tailspec.drafter_trainer.training_session import TrainingSession

    from tests.test_trainer_session import cfg, frozen_teacher, make_buffer

    ls = Leases(redis_client, "k")
    lease = ls.acquire("n0", 0, "s", ttl_s=30)
    ctx = _ctx(redis_url, lease.token)
    teacher = frozen_teacher()
    s = TrainingSession(cfg(tmp_path), teacher, make_buffer(), should_continue=ctx.should_continue)
    layers = teacher.model.model.layers
    ran: list[list[int]] = []
    pushed_in: list[float] = []

    def layer0(_m, _i, _o):
        ran.append([0])

    def layer1(_m, _i, _o):
        ran[-1].append(1)
        if len(ran) == 3:
            t0 = time.monotonic()
            ls.revoke("n0", 0, lease.token)
            assert ctx.keeper.wait_stopped(2.0)
            pushed_in.append(time.monotonic() - t0)

    def later(j):
        return lambda _m, _i, _o: ran[-1].append(j)

    hooks = [layers[0].register_forward_hook(layer0), layers[1].register_forward_hook(layer1),
             *(layers[j].register_forward_hook(later(j)) for j in range(2, len(layers)))]
    try:
        res = s.run(max_steps=50)
    finally:
        for h in hooks:
            h.remove()
        ctx.close()
    n = len(layers)
    assert ran == [list(range(n)), list(range(n)), [0, 1]], ran
    assert res.steps == 2 and res.stop_reason == "should_continue" and ctx.stop_reason == "revoked"
    assert pushed_in[0] < 0.5, pushed_in  # a push, not a renewal (every 7.5 s at this TTL)
    assert res.stop_latency_s is not None and res.stop_latency_s < 1.0


def test_a_paused_renewal_thread_stops_the_session_writing_at_lease_expiry(redis_client, redis_url):
    """A session reports every 10 ms while should_continue(); its renewal thread then hangs in a renewal. The
    session stops on its lease clock before Redis lets the lease lapse, every report it made landed while the
    lease lived, and after the expiry its writes are refused."""
    ls = Leases(redis_client, "k")
    lease_key = state.key("k", "lease", node="n0", gpu=0)
    ttl = 1.0
    lease = ls.acquire("n0", 0, "s", ttl_s=ttl)
    ctx = _ctx(redis_url, lease.token, ttl=ttl)
    reports: list[tuple[float, bool]] = []
    stopped: list[tuple[float, int]] = []

    def session() -> None:
        step = 0
        while ctx.should_continue():
            step += 1
            reports.append((time.monotonic(), ctx.report(step)))
            time.sleep(0.01)
        stopped.append((time.monotonic(), redis_client.pttl(lease_key)))

    th = threading.Thread(target=session)
    th.start()
    gate = threading.Event()
    time.sleep(0.6)
    ctx.keeper.renew = lambda: gate.wait() and None  # the thread's next renewal hangs: no renewal, no listening
    paused_at = time.monotonic()
    th.join(5.0)
    try:
        assert stopped, "the session did not stop"
        stop_t, pttl_at_stop = stopped[0]
        assert ctx.stop_reason == "lease renewal late"
        assert pttl_at_stop > 0, pttl_at_stop  # stopped while its lease still lived: before Redis let it lapse
        assert stop_t - paused_at <= ttl + 0.3  # at most a renewal period late (0.25 s) plus STOP_AT of a TTL
        assert reports and all(ok for _, ok in reports)  # every write it made landed: none came after the expiry
        time.sleep(pttl_at_stop / 1000 + 0.1)
        assert redis_client.get(lease_key) is None  # nobody renewed it: expired
        assert not ctx.report(999) and not ls.fenced_set("n0", 0, lease.token, "x", "1")
    finally:
        gate.set()
        ctx.close()
