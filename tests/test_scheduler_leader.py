"""Standby schedulers on a real redis-server: one leads under a fenced leader key, the others stand by and take
over within one leader TTL; a deposed leader's lends, revokes and renewals are refused by its stale epoch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import Event, GpuTelemetry, Lease, PhaseInfo, Progress, SessionInfo
from tailspec.scheduler import leases as L
from tailspec.scheduler.leader import LeaderElection, current_leader
from tailspec.scheduler.leases import LeaderLost, Leases
from tailspec.scheduler.monitor import publish_samples
from tailspec.scheduler.session_process import SessionContext

ENTRY = "tailspec.scheduler.busy_sessions:busy_session"
NODE = "node0"


def wait_for(pred, timeout: float, what: str, period: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def make_cfg(url: str, cluster: str, leader_ttl: float, lease_ttl: float = 2.0) -> TailspecConfig:
    cfg = TailspecConfig()
    cfg.cluster.name = cluster
    cfg.cluster.redis_url = url
    cfg.scheduler.telemetry = "simulated"
    cfg.scheduler.session_entry = ENTRY
    cfg.scheduler.lease_ttl_s = lease_ttl
    cfg.scheduler.leader_ttl_s = leader_ttl
    cfg.scheduler.session_startup_s = 0.0
    cfg.scheduler.idle_window_s = 0.0
    return cfg


@dataclass
class RecordingDispatcher:
    """Starts nothing: records the sessions a scheduler would start (the fencing lives in Redis, not here)."""

    started: list[SessionContext] = field(default_factory=list)
    ended: dict[str, int] = field(default_factory=dict)

    def start(self, ctx: SessionContext) -> None:
        self.started.append(ctx)

    def stop(self, session_id: str) -> None: ...

    def cancel(self, session_id: str) -> None: ...

    def poll(self) -> set[str]:
        return set(self.ended)

    def forget(self, session_id: str) -> None:
        self.ended.pop(session_id, None)

    def shutdown(self) -> None: ...


def publish(r, cluster: str, busy: set[int], gpus: tuple[int, ...] = (0, 1, 2)) -> None:
    """One rollout snapshot, written directly: worker w{g} owns GPU g; GPUs in `busy` generate, the others
    drained; telemetry fresh and idle (utilization 0) for every GPU."""
    now = time.time()
    state.put(r, state.key(cluster, "phase"), PhaseInfo(phase="rollout", step=1, started_at=now - 30))
    for g in gpus:
        w = f"w{g}"
        r.sadd(state.key(cluster, "workers"), w)
        r.sadd(state.key(cluster, "gpus"), f"{NODE}:{g}")
        active = 3 if g in busy else 0
        state.put(r, state.key(cluster, "progress", worker=w),
                  Progress(worker=w, node=NODE, gpus=[g], active=active, finished=5, phase="rollout", step=1,
                           ts=now - 0.01))
    publish_samples(r, cluster, [GpuTelemetry(node=NODE, gpu=g, util=0.0, mem_used=0, mem_total=80 << 30,
                                              simulated=True, ts=now) for g in gpus])


def lease_on(r, cluster: str, gpu: int) -> Lease | None:
    return state.get(r, state.key(cluster, "lease", node=NODE, gpu=gpu), Lease)


def test_exactly_one_leads_and_the_standby_writes_nothing(redis_url, redis_client):
    from tailspec.scheduler.service import Scheduler

    from tailspec.top import gather, render_text

    cl = "lead-one"
    cfg = make_cfg(redis_url, cl, leader_ttl=5.0)
    a = Scheduler(cfg, redis_client, RecordingDispatcher(), holder="a")
    b = Scheduler(cfg, redis_client, RecordingDispatcher(), holder="b")
    publish(redis_client, cl, busy={1, 2})
    a.tick()
    assert a.leading and a.role == "leader" and a.epoch == 1
    before = {k: redis_client.get(k) for k in redis_client.keys(f"tailspec:{cl}:*") if redis_client.type(k) == b"string"}
    streams = {k: redis_client.xlen(k) for k in redis_client.keys(f"tailspec:{cl}:*") if redis_client.type(k) == b"stream"}
    for _ in range(20):
        assert b.tick() == []
    assert not b.leading and b.role == "standby" and b.election.leader.holder == "a"
    after = {k: redis_client.get(k) for k in before}
    assert after == before, "a standby's tick wrote cluster state"
    assert {k: redis_client.xlen(k) for k in streams} == streams
    assert b.dispatcher.started == [] and b.detector.machines == {}
    # The leader acts: GPU 0 is drained and idle, lent under epoch 1.
    publish(redis_client, cl, busy={1, 2})
    a.tick()
    lease = lease_on(redis_client, cl, 0)
    assert lease is not None and lease.epoch == 1 and len(a.dispatcher.started) == 1
    text = render_text(gather(redis_client, cl), cl)
    assert "leader a (epoch 1)" in text, text
    a.shutdown()  # a clean exit gives the key up: the standby leads at its next tick
    assert current_leader(redis_client, cl) is None
    b.tick()
    assert b.leading and b.epoch == 2


def test_deposed_leader_cannot_lend_revoke_or_renew(redis_url, redis_client):
    """A leads and lends GPU 0, then pauses past its leader TTL; B takes over. A wakes up believing it still
    leads (its tick's renewal happened before the pause): its lend, its revoke and its lease renewal are
    refused by the stale epoch, it stands by, and only B's leases ever exist afterwards."""
    from tailspec.scheduler.service import Scheduler

    cl = "deposed"
    ttl = 0.3
    cfg = make_cfg(redis_url, cl, leader_ttl=ttl, lease_ttl=0.6)
    a = Scheduler(cfg, redis_client, RecordingDispatcher(), holder="a")
    b = Scheduler(cfg, redis_client, RecordingDispatcher(), holder="b")
    publish(redis_client, cl, busy={1, 2})  # GPU 2 is the tail throughout
    a.tick()
    a.tick()
    assert a.leading and len(a.live) == 1
    lent = lease_on(redis_client, cl, 0)
    assert lent is not None and lent.epoch == a.epoch
    b.tick()
    assert not b.leading
    # A pauses (no renewal); B keeps ticking and takes over once A's key expires.
    t_pause = time.monotonic()
    wait_for(lambda: b.tick() is not None and b.leading, 2 * ttl + 1, "the standby to take over", period=0.05)
    took = time.monotonic() - t_pause
    assert took <= ttl + cfg.scheduler.tick_s + 0.15, f"take-over {took:.3f}s after the last renewal (ttl {ttl}s)"
    assert b.epoch > a.epoch
    stale = a.epoch
    # A's writes with its stale epoch, straight at the scripts:
    assert a.leases.renew(NODE, 0, lent.token, 5.0, require_heartbeat=False) == L.DEPOSED
    with pytest.raises(LeaderLost):
        a.leases.acquire(NODE, 1, "a", 5.0, epoch=stale)
    with pytest.raises(LeaderLost):
        a.leases.revoke(NODE, 0, lent.token, epoch=stale)
    assert redis_client.get(state.key(cl, "revoke", node=NODE, gpu=0)) is None  # the refused revoke wrote nothing
    assert lease_on(redis_client, cl, 1) is None
    # ... and through its own tick: its renewal is taken as done (the pause fell between renewal and lend), GPU 1
    # has drained meanwhile, so A's stale state machine wants to lend it.
    publish(redis_client, cl, busy={2})
    real_hold = a.election.hold
    a.election.hold = lambda renewed=None: True
    assert a.tick() == []
    a.election.hold = real_hold
    assert not a.leading and a.role == "standby" and a.live == {} and list(a.orphans) == [f"{NODE}-g0-t{lent.token}"]
    assert lease_on(redis_client, cl, 1) is None and len(a.dispatcher.started) == 1
    # B lends GPU 1 at once and GPU 0 once A's lease (renewed by nobody) has expired; never two leases on a GPU.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and len(b.live) < 2:
        publish(redis_client, cl, busy={2})
        b.tick()
        a.tick()
        assert not a.leading
        time.sleep(0.02)
    assert sorted(g for _, g, _ in b.live.values()) == [0, 1]
    for g in (0, 1):
        lease = lease_on(redis_client, cl, g)
        assert lease is not None and lease.epoch == b.epoch and lease.token > lent.token
    assert len(a.dispatcher.started) == 1 and len(b.dispatcher.started) == 2


# -- SIGKILL of a real `tailspec scheduler run` leader, a real standby taking over -----------------------------


def _scheduler_cmd(url: str, cluster: str, logs: str, leader_ttl: float, lease_ttl: float) -> list[str]:
    sets = {
        "cluster.name": cluster,
        "scheduler.telemetry": "simulated",
        "scheduler.simulated_gpus": 3,
        "scheduler.session_entry": ENTRY,
        "scheduler.lease_ttl_s": lease_ttl,
        "scheduler.leader_ttl_s": leader_ttl,
        "scheduler.session_startup_s": 0,
    }
    cmd = [sys.executable, "-m", "tailspec.cli", "scheduler", "run", "--redis", url, "--session-logs", logs]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


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


def _sessions(r, cluster: str) -> dict[str, SessionInfo]:
    out = {}
    for sid in r.smembers(state.key(cluster, "sessions")):
        info = state.get(r, state.key(cluster, "session", session_id=sid.decode()), SessionInfo)
        if info is not None:
            out[sid.decode()] = info
    return out


def test_sigkill_leader_standby_takes_over_within_one_leader_ttl(redis_url, redis_client, tmp_path):
    from tailspec.scheduler.client import TailspecClient

    cl = "failover"
    leader_ttl, lease_ttl, tick = 1.0, 2.0, TailspecConfig().scheduler.tick_s
    procs = []
    for i in range(2):
        (tmp_path / f"s{i}").mkdir()
        cmd = _scheduler_cmd(redis_url, cl, str(tmp_path / f"s{i}"), leader_ttl, lease_ttl)
        with open(tmp_path / f"sched{i}.log", "wb") as out:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
    c = TailspecClient(redis_url, cluster=cl, node=NODE)
    orphan_pids: list[int] = []
    try:
        first = wait_for(lambda: current_leader(redis_client, cl), 60, "a leader")
        by_pid = {p.pid: p for p in procs}
        leader, standby = by_pid[first.pid], next(p for p in procs if p.pid != first.pid)
        wait_for(lambda: "standing by" in (tmp_path / f"sched{procs.index(standby)}.log").read_text(), 60,
                 "the standby to say so")
        c.set_phase("rollout", step=1)
        c.report_progress("w0", [0], active=0, finished=8, step=1)
        c.report_progress("w1", [1], active=3, finished=5, step=1)
        c.report_progress("w2", [2], active=0, finished=8, step=1)
        wait_for(lambda: sum(s.status == "running" and s.step >= 2 for s in _sessions(redis_client, cl).values()) == 2,
                 60, "two running sessions")
        old = {g: lease_on(redis_client, cl, g) for g in (0, 2)}
        assert all(x is not None and x.epoch == first.epoch for x in old.values())
        orphan_pids = _children(leader.pid)
        t_kill = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        leader.wait(5)
        # Sample the cluster every 5 ms: the leader record, and the lease on every GPU.
        seen: list[tuple[float, int | None, dict[int, int | None]]] = []
        new = None
        gone: dict[int, float] = {}
        while time.monotonic() - t_kill < leader_ttl + lease_ttl + 3:
            c.report_progress("w1", [1], active=3, finished=5, step=1)  # the tail goes on
            now = time.monotonic() - t_kill
            ld = current_leader(redis_client, cl)
            toks = {g: (x.token if (x := lease_on(redis_client, cl, g)) else None) for g in (0, 1, 2)}
            seen.append((now, ld.epoch if ld else None, toks))
            if ld is not None and ld.epoch != first.epoch and new is None:
                new = (now, ld)
            for g, lease in old.items():
                if g not in gone and toks[g] != lease.token:
                    gone[g] = now
            if new and len(gone) == 2 and all(toks[g] is not None for g in (0, 2)):
                break  # the new leader has lent both GPUs again
            time.sleep(0.005)
        assert new is not None, "no standby took over"
        took, ld = new
        assert ld.pid == standby.pid and ld.epoch > first.epoch
        assert took <= leader_ttl + tick + 0.25, f"take-over {took:.2f}s after SIGKILL (leader ttl {leader_ttl}s)"
        # The killed leader's leases were not renewed by anyone after the take-over: each expired within one
        # lease TTL of the leader key's expiry (its sessions' renewals are refused, then the key times out).
        for g in (0, 2):
            assert gone[g] <= leader_ttl + lease_ttl + 0.25, f"GPU {g}'s old lease lived {gone[g]:.2f}s"
        # Never two leases on a GPU, and the new ones are the new leader's.
        for g in (0, 2):
            toks = [t[2][g] for t in seen]
            changes = [x for i, x in enumerate(toks) if i == 0 or x != toks[i - 1]]
            assert changes[0] == old[g].token and None in changes[1:2], changes  # old → free → new
            lease = lease_on(redis_client, cl, g)
            assert lease is not None and lease.epoch == ld.epoch and lease.token > old[g].token
        assert all(t[2][1] is None for t in seen)  # the generating GPU was never lent
        # No GPU lent twice: per GPU, a session started only after the one before it had stopped.
        def settled():  # the old sessions' final records, the new ones listed (the tick's pipeline follows the lend)
            sess = _sessions(redis_client, cl)
            old_done = all(s.status in ("stopped", "failed") for s in sess.values()
                           if s.lease_token in {x.token for x in old.values()})
            return sess if old_done and sum(s.gpu in (0, 2) for s in sess.values()) >= 4 else None

        sess = wait_for(settled, 10, "old sessions' final records and the new sessions")
        for g in (0, 2):
            mine = sorted((s for s in sess.values() if s.gpu == g), key=lambda s: s.started_at)
            assert len(mine) >= 2
            for prev, nxt in pairwise(mine):
                assert prev.stopped_at is not None and prev.stopped_at <= nxt.started_at, (prev, nxt)
            assert mine[0].stop_reason in ("leader changed", "scheduler heartbeat lost"), mine[0]
        events, _ = state.read_stream(redis_client, state.key(cl, "events"), Event)
        elected = [e for _, e in events if e.kind == "leader_elected"]
        assert [e.detail["epoch"] for e in elected] == [first.epoch, ld.epoch]
        assert elected[1].detail["expiring"] == 2 and elected[1].detail["revoked"] == 0
        log = (tmp_path / f"sched{procs.index(standby)}.log").read_text()
        assert "standing by" in log and f"leads cluster {cl} (epoch {ld.epoch})" in log, log
        print(f"take-over {took:.3f}s after SIGKILL (leader ttl {leader_ttl}s, tick {tick}s); old leases gone at "
              f"{', '.join(f'{v:.2f}s' for v in gone.values())} (lease ttl {lease_ttl}s)")
    finally:
        c.close()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        for pid in orphan_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# -- property: random interleavings among three contenders ------------------------------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["hold", "hold", "lend", "renew", "session_renew", "revoke", "expire_leader",
                         "expire_lease"]),
        st.integers(0, 2),  # contender
        st.integers(0, 1),  # gpu
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_property_one_valid_leader_and_one_lease_per_gpu(redis_client, ops):
    """Contenders hold (renew or take) the leader key, lend, renew and revoke with whatever epoch they believe
    they have; the leader key and leases expire at random points (a pause past a TTL). Never two contenders
    whose epochs are valid at once, never a lend or renewal under an epoch that does not lead, never two
    renewable holders of one GPU."""
    cl = "prop"
    redis_client.flushall()
    redis_client.set(state.key(cl, "scheduler_heartbeat"), "1", px=60_000)
    contenders = [LeaderElection(redis_client, cl, NODE, ttl_s=30, heartbeat_px=60_000, holder=f"c{i}")
                  for i in range(3)]
    ls = Leases(redis_client, cl)
    held: dict[tuple[int, int], int] = {}  # (contender, gpu) → the token it believes it holds
    won: list[int] = []

    def leading_epoch() -> int | None:
        ld = current_leader(redis_client, cl)
        return ld.epoch if ld else None

    for op, i, g in ops:
        me = contenders[i]
        if op == "hold":
            before = me.epoch
            me.hold()
            if me.epoch is not None and me.epoch != before:
                assert not won or me.epoch > won[-1]  # epochs strictly increase
                won.append(me.epoch)
        elif op == "lend" and me.epoch is not None:
            lead = leading_epoch()
            try:
                lease = ls.acquire(NODE, g, me.holder, 30, epoch=me.epoch)
            except LeaderLost:
                assert lead != me.epoch
            else:
                assert lead == me.epoch
                if lease is not None:
                    assert lease.epoch == me.epoch
                    held[(i, g)] = lease.token
        elif op in ("renew", "session_renew") and (i, g) in held:
            lease = lease_on(redis_client, cl, g)
            code = ls.renew(NODE, g, held[(i, g)], 30, require_heartbeat=op == "session_renew")
            if code == L.RENEWED:
                assert lease is not None and lease.token == held[(i, g)] and lease.epoch == leading_epoch()
        elif op == "revoke" and (i, g) in held and me.epoch is not None:
            try:
                ls.revoke(NODE, g, held[(i, g)], epoch=me.epoch)
            except LeaderLost:
                assert leading_epoch() != me.epoch
        elif op == "expire_leader":
            redis_client.delete(state.key(cl, "leader"))
        elif op == "expire_lease":
            redis_client.delete(state.key(cl, "lease", node=NODE, gpu=g))
        # Invariants after every operation.
        lead = leading_epoch()
        valid = [c for c in contenders if c.epoch is not None and c.epoch == lead]
        assert len(valid) <= 1
        for gpu in (0, 1):
            cur = lease_on(redis_client, cl, gpu)
            if cur is not None:
                assert cur.epoch in won
            renewable = [tok for (_, gg), tok in held.items() if gg == gpu
                         and ls.renew(NODE, gpu, tok, 30, require_heartbeat=False) == L.RENEWED]
            assert len(set(renewable)) <= 1
            if renewable:
                assert cur is not None and cur.token == renewable[0] and cur.epoch == lead
