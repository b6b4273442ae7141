"""The scheduler loop: read the cluster state, step the per-GPU state machines, act.

Each tick (default 50 ms) renews the leader key and reads phase, progress, every node's GPU health and the
telemetry samples of the drained GPUs from Redis in one round trip (scheduler/observe.py: a GPU drained since the
last tick costs one more; a payload unchanged since the last tick is not decoded again), runs `IdleDetector.tick`
(which steps only the machines whose step could decide something new, scheduler/idle_index.py), and executes its
actions: lend (fenced lease + session start), revoke (revoke flag + lease delete), reclaimed (release, backstop
stop, final records). However many GPUs the actions concern, they take a fixed number of round trips and commands
(one bulk lease script per kind and one MGET of the session records, then the new sessions' records; the
term's Lessor, scheduler/lessor.py, owns the leases: grant, renew, revoke, reclaim), every lease the leader renews
goes in one script call (Leases.renew_many), and the tick's events, status history and final records are written
at its end with one command per stream and one MSET (scheduler/tick_writes.py), so a tick's round trips stay few
at a thousand GPUs (`tailspec bench scheduler --gpus 1024` counts them). It also keeps the
dashboards' keys filled: gpu_status + history:status on every transition, counters (idle/lent
GPU-seconds, sessions started/stopped/preempted), events, and the heartbeat that sessions' lease
renewals require — so a dead scheduler means every session stops within one lease TTL.

Any number of schedulers may run per cluster; one leads (scheduler/leader.py). Every tick starts by
renewing the leader key, or, on a standby, by trying to take it. A standby's tick writes nothing else;
only the leader reads the cluster state and acts, and its lends, revokes and lease renewals carry its
epoch, which the lease scripts check (scheduler/leases.py). A scheduler that loses its term forgets its
GPU state machines and stands by; its sessions stop at their next renewal (refused: "leader changed")
and their leases expire within one lease TTL.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import Event, GpuState, GpuStatus, Lease, StateError
from tailspec.scheduler import cpu_quota
from tailspec.scheduler.dispatch import LocalDispatcher
from tailspec.scheduler.idle import Action, IdleDetector
from tailspec.scheduler.leader import LeaderElection
from tailspec.scheduler.leases import LeaderLost, Leases
from tailspec.scheduler.lessor import Lessor
from tailspec.scheduler.monitor import TelemetryMonitor
from tailspec.scheduler.observe import Observer, Sent
from tailspec.scheduler.phase_wake import PhaseWake
from tailspec.scheduler.placement import simulated_gpu_placement
from tailspec.scheduler.session_process import WARM_POLICY_ENV
from tailspec.scheduler.telemetry import SharedDevice, make_telemetry
from tailspec.scheduler.tick_writes import TickWrites

log = logging.getLogger(__name__)

COUNTER_FLUSH_S = 0.25


@dataclass(frozen=True)
class Inherited:
    """What a new leader found on the GPUs at its take-over."""

    revoked: int  # leases granted outside any leader epoch: nobody would stop their sessions, revoked at once
    expiring: int  # leases of earlier epochs: unrenewable now (leases.DEPOSED), left to expire within one TTL


@dataclass
class Scheduler:
    cfg: TailspecConfig
    r: Any
    dispatcher: Any
    redis_url: str | None = None  # what sessions connect to (defaults to cfg.cluster.redis_url)
    require_heartbeat: bool = True
    holder: str = ""  # this instance's name in the leader key (default: node, pid, random suffix)
    bad_payloads: int = 0
    errors: int = 0
    ticks: int = 0
    live: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # session id → (node, gpu, token)

    def __post_init__(self) -> None:
        sc = self.cfg.scheduler
        self.c = self.cfg.cluster.name
        self.leases = Leases(self.r, self.c)
        self.election = LeaderElection(
            self.r, self.c, self.cfg.cluster.node, sc.leader_ttl_s, heartbeat_px=self._heartbeat_px(),
            holder=self.holder,
        )
        self.holder = self.election.holder
        self._writes = TickWrites(self.r, sc.history_maxlen)  # the tick's events, status history, final records
        self.sent = Sent()  # what the observer sent as packed bytes (the client's command hooks miss it)
        # Sessions started in a term this instance lost: session id → when to stop them if still running.
        self.orphans: dict[str, float] = {}
        self._role_logged: str | None = None
        self._reset_term_state()
        self._stop = threading.Event()

    def _new_detector(self) -> IdleDetector:
        sc = self.cfg.scheduler
        return IdleDetector(
            util_threshold=sc.idle_util_threshold,
            window_s=sc.idle_window_s,
            startup_s=sc.session_startup_s,
            stop_deadline_s=sc.stop_deadline_s,
            lend=sc.lend,
            require_release=sc.require_release,
            lend_on_release=sc.lend_on_release,
            min_free_bytes=int(sc.min_free_mem_gib * (1 << 30)),
        )

    def _reset_term_state(self) -> None:
        """What a term's decisions rest on, fresh: a leader starts from what it observes itself."""
        self.detector = self._new_detector()
        self.lessor = Lessor(
            self.cfg, self.r, self.leases, self.dispatcher, self.detector, self._writes, self.live, self.epoch,
            redis_url=self.redis_url or self.cfg.cluster.redis_url, require_heartbeat=self.require_heartbeat,
            bad=self._bad, failed=self._failed,
        )
        self._published: dict[tuple[str, int], tuple[GpuState, float]] = {}
        self._observer = Observer(self.r, self.c, self._bad, self.sent)
        self._last_tick: float | None = None
        self._last_flush = float("-inf")
        self._idle_acc = self._lent_acc = 0.0

    def _heartbeat_px(self) -> int:
        # Expires before one lease TTL is over, so sessions' renewals fail within one TTL of the leader's death.
        return max(50, int(self.cfg.scheduler.lease_ttl_s * 750))

    @property
    def leading(self) -> bool:
        return self.election.leading

    @property
    def epoch(self) -> int | None:
        return self.election.epoch

    @property
    def role(self) -> str:
        return "leader" if self.leading else "standby"

    # -- state snapshot ------------------------------------------------------------------------
    def _bad(self, where: str, err: Exception) -> None:
        self.bad_payloads += 1
        if self.bad_payloads in (1, 10) or self.bad_payloads % 100 == 0:
            log.warning(
                "scheduler: skipping bad payload at %s: %s (%d so far)", where, err, self.bad_payloads
            )

    def _failed(self) -> None:
        self.errors += 1

    # -- leadership ----------------------------------------------------------------------------
    def recover(self) -> Inherited:
        """At a take-over: leases of earlier epochs are left to expire (the renew script refuses them now, so
        their sessions stop at their next renewal and the GPU is not lent again before the lease is gone);
        leases granted outside any epoch are revoked, as nothing else would end them. Leader only."""
        if not self.leading:
            raise LeaderLost(f"scheduler {self.holder} does not lead cluster {self.c}")
        revoked = expiring = 0
        for k in self.r.scan_iter(match=state.key(self.c, "lease", node="*", gpu="*"), count=200):
            try:
                lease = state.get(self.r, state.text(k), Lease)
            except StateError:
                self.r.delete(k)
                continue
            if lease is None or lease.epoch == self.epoch:
                continue
            if lease.epoch is not None:
                expiring += 1
                continue
            self.leases.revoke(lease.node, lease.gpu, lease.token, epoch=self.epoch)
            self._event("lease_revoked", lease.node, lease.gpu, token=lease.token,
                        reason="granted outside any leader epoch")
            revoked += 1
        return Inherited(revoked=revoked, expiring=expiring)

    def _hold_lead(self, now: float) -> tuple | None:
        """Renew this instance's term or try to take one; act on a term lost or won. A leader renews in the round
        trip of the tick's reads (scheduler/observe.py): their phase and progress are returned while the same term
        goes on (None otherwise: what was read is dropped)."""
        before = self.election.epoch
        read = None
        try:
            if before is None:
                self.election.hold()
            else:
                phase, progress, renewed = self._observer.read(self.election.renew_command())
                read = (phase, progress)
                self.election.hold(renewed)
        finally:  # a renewal refused, then a failed attempt to take the key again: the term is still lost
            if before is not None and self.election.epoch != before:
                self._lose_term(before, now)
        if self.leading and self.election.epoch != before:
            self._take_over(now)
        self._log_role()
        return read if self.election.epoch == before else None

    def _lose_term(self, epoch: int, now: float) -> None:
        """Deposed (paused or cut off past the leader TTL, and another instance took the key): forget the
        term's state. Its sessions are refused at their next renewal; their processes are stopped by the
        backstop if still running after one lease TTL and the stop deadline."""
        log.warning("scheduler %s: lost the lead of cluster %s (epoch %d); standing by", self.holder, self.c, epoch)
        sc = self.cfg.scheduler
        for sid in self.live:
            self.orphans[sid] = now + sc.lease_ttl_s + sc.stop_deadline_s
        self.live.clear()
        self._reset_term_state()

    def _take_over(self, now: float) -> None:
        self._reset_term_state()
        found: dict[str, int] = {}
        try:
            found = asdict(self.recover())
        except LeaderLost:
            raise
        except Exception as e:  # Redis blip: earlier epochs' leases are fenced by the renew script anyway
            log.warning("scheduler %s: take-over scan failed: %s", self.holder, e)
        self._event("leader_elected", None, None, epoch=self.epoch, holder=self.holder, **found)
        log.info("scheduler %s: leads cluster %s (epoch %d); earlier leases: %s", self.holder, self.c,
                 self.epoch, found or "not scanned")

    def _log_role(self) -> None:
        if self.role == self._role_logged:
            return
        self._role_logged = self.role
        if not self.leading:
            ld = self.election.leader
            log.info("scheduler %s: standing by for cluster %s (leader %s, epoch %s)", self.holder, self.c,
                     ld.holder if ld else "none", ld.epoch if ld else "-")

    def _reap_orphans(self, ended: set[str], now: float) -> None:
        """Sessions of a lost term: forget them when they end; stop them past their deadline."""
        for sid, deadline in list(self.orphans.items()):
            if sid in ended:
                self.dispatcher.forget(sid)
                del self.orphans[sid]
            elif now >= deadline:
                self.dispatcher.stop(sid)

    # -- lifecycle -----------------------------------------------------------------------------

    def _event(self, kind: str, node: str | None, gpu: int | None, **detail: Any) -> None:
        """Append an event now (a tick's events queue on its writes: Lessor)."""
        ev = Event(kind=kind, node=node, gpu=gpu, detail=detail)  # type: ignore[arg-type]
        self.r.xadd(
            state.key(self.c, "events"),
            {"data": state.encode(ev)},
            maxlen=self.cfg.scheduler.history_maxlen,
            approximate=True,
        )

    # -- one tick ------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[Action]:
        """Hold the lead (renewal writes the sessions' heartbeat) or try to take it; lead if leading."""
        now = time.time() if now is None else now
        try:
            read = self._hold_lead(now)
            ended = self.dispatcher.poll()
            self._reap_orphans(ended, now)
            self.ticks += 1
            return self._lead(now, ended, read) if self.leading else []
        except LeaderLost as e:  # deposed since this tick's renewal: the refused write and the rest are dropped
            log.warning("scheduler %s: %s", self.holder, e)
            epoch, self.election.epoch = self.election.epoch, None
            if epoch is not None:
                self._lose_term(epoch, now)
            self._log_role()
            return []

    def _lead(self, now: float, ended: set[str], read: tuple | None) -> list[Action]:
        self._writes.drop()  # what an aborted tick queued was never written, as its pipeline was not
        phase, progress = read or self._observer.read()[:2]  # read with the renewal, or after a take-over
        telemetry = self._observer.telemetry(self.detector.sampled(phase, progress, ended))
        # GPU-seconds over the interval since the last tick, by the states held during it.
        dt = 0.0 if self._last_tick is None else min(max(0.0, now - self._last_tick), 1.0)
        self._last_tick = now
        n_idle = self.detector.count(GpuState.DRAINED, GpuState.LENT)
        n_lent = self.detector.count(GpuState.LENT)

        actions = self.detector.tick(now, phase, progress, telemetry, ended)
        pipe = self.r.pipeline(transaction=False)
        if actions:
            self.lessor.execute(actions, now, pipe)
        self.lessor.renew(now, pipe)
        self._publish_status(now, pipe)
        self._idle_acc += dt * n_idle
        self._lent_acc += dt * n_lent
        if now - self._last_flush >= COUNTER_FLUSH_S or actions:  # dashboards need ~4 Hz, not 20 Hz
            self._flush_counters(pipe)
            self._last_flush = now
        self._writes.flush(pipe)
        pipe.execute()
        return actions

    def _flush_counters(self, pipe: Any) -> None:
        ck = state.key(self.c, "counters")
        if self._idle_acc:
            pipe.hincrbyfloat(ck, "idle_gpu_seconds", self._idle_acc)
        if self._lent_acc:
            pipe.hincrbyfloat(ck, "lent_gpu_seconds", self._lent_acc)
        self._idle_acc = self._lent_acc = 0.0

    def _publish_status(self, now: float, pipe: Any) -> None:
        changed: dict[str, bytes] = {}
        machines, history = self.detector.machines, state.key(self.c, "status_history")
        for key in self.detector.changed():  # a machine neither stepped nor changed kept its state and since
            m = machines[key]
            cur = (m.state, m.since)
            if self._published.get(key) == cur:
                continue
            self._published[key] = cur
            st = GpuStatus(
                node=m.node,
                gpu=m.gpu,
                state=m.state,
                since=m.since,
                worker=m.worker,
                lease_token=m.lease_token,
                session_id=m.session_id,
            )
            data = state.encode(st)
            changed[state.key(self.c, "gpu_status", node=m.node, gpu=m.gpu)] = data
            self._writes.append(history, data)
        if changed:
            pipe.mset(changed)

    # -- loop ----------------------------------------------------------------------------------
    def serve(self, stop: threading.Event | None = None) -> None:
        stop = stop or self._stop
        _quiet_gc()
        period = self.cfg.scheduler.tick_s
        wake = PhaseWake(self.r, state.key(self.c, "phase"), stop).start()
        try:
            self._serve(stop, wake, period)
        finally:
            wake.close()

    def _serve(self, stop: threading.Event, wake: PhaseWake, period: float) -> None:
        next_t = time.monotonic()
        while not stop.is_set():
            try:
                self.tick()
            except Exception as e:  # Redis down: sessions stop on their own; keep trying
                self.errors += 1
                if self.errors in (1, 10) or self.errors % 100 == 0:
                    log.warning("scheduler tick failed: %s (%d errors)", e, self.errors)
            next_t += period
            delay = next_t - time.monotonic()
            if delay < 0:
                next_t, delay = time.monotonic(), 0
            if wake.wait(delay):  # a phase change: tick now, and the grid goes on from here
                next_t = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Clean exit: a leader revokes every lease it granted, stops its sessions and gives the leader key
        up (a standby takes over at its next tick); a standby only stops its own processes."""
        if self.leading:
            try:
                pipe = self.r.pipeline(transaction=False)
                self._flush_counters(pipe)
                pipe.execute()
            except Exception:
                pass
        if self.leading:
            self.lessor.revoke_live()
        self.dispatcher.shutdown()
        for sid in [*self.live, *self.orphans]:
            try:
                self.lessor.finalize_record(sid, "scheduler shut down")
            except Exception:
                pass
        self.live.clear()
        self.orphans.clear()
        try:
            self.election.release()
        except Exception:
            pass


def _quiet_gc() -> None:
    """The collector tuned for the scheduler's process (serve runs for the process's life). What exists when the
    loop starts (modules, schemas, config) lives as long as the process: frozen, out of the full passes, which
    would walk all of it and stall a tick. A tick at a thousand GPUs allocates thousands of short-lived objects
    (decoded payloads, snapshot dicts): the youngest generation is collected every 20,000 net allocations rather
    than Python's default 700, which would run a collection every tick or two."""
    gc.freeze()
    gc.set_threshold(20_000, 20, 10)


def run_local(
    cfg: TailspecConfig,
    stop: threading.Event | None = None,
    redis_url: str | None = None,
    log_dir: str | None = None,
) -> None:
    """Single-node mode: one process with the telemetry monitor (thread) and the scheduler loop."""
    url = redis_url or cfg.cluster.redis_url
    sc = cfg.scheduler
    r = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    shared = (SharedDevice(sc.simulated_gpu_device, sc.simulated_gpu_sharing)
              if sc.simulated_gpu_device is not None and sc.telemetry == "simulated" else None)
    telemetry, warning = make_telemetry(
        sc.telemetry, cfg.cluster.node, r, cfg.cluster.name, sc.simulated_gpus,
        simulated_mem=int(sc.simulated_gpu_mem_gib * (1 << 30)), shared_device=shared,
    )
    monitor = TelemetryMonitor(
        telemetry, r, cfg.cluster.name, sc.sample_period_s, sc.history_maxlen, warning=warning
    ).start()
    gpu_cpus, gpu_cgroups = simulated_gpu_placement(cfg) if telemetry.simulated else (None, None)
    dispatcher = LocalDispatcher(sc.session_entry, log_dir=log_dir, warm=sc.warm_sessions, nice=sc.session_nice,
                                 gpu_cpus=gpu_cpus, gpu_cgroups=gpu_cgroups, gpu_env=sc.simulated_gpu_env or None,
                                 extra_env={WARM_POLICY_ENV: sc.warm_policy} if sc.warm_policy else {})
    sched = Scheduler(cfg, r, dispatcher, redis_url=url)
    stop = stop or threading.Event()
    try:
        sched.serve(stop)
    finally:
        monitor.stop()
        sched.shutdown()
        for cg in (dispatcher.gpu_cgroups or {}).values():  # sessions are gone: the quotas with them
            cpu_quota.remove(cg)
