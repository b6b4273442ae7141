"""The lessor: the leading scheduler's side of its GPU leases for one term. It grants them (a lend: the fenced
lease, the session's "starting" record, its process), renews the live ones, revokes them (revoke flag + lease
delete; a session still starting is cancelled), and reclaims them (release, the backstop stop, the final record).
Every lease write carries the term's epoch, which the lease scripts check (scheduler/leases.py). The scheduler
(scheduler/service.py) makes a new lessor at every change of term, with the term's detector and epoch.

One tick's actions take a fixed number of round trips and commands however many GPUs they concern: one bulk lease
script per kind (every lend's acquire, every revoke, every release) and one MGET of the session records they
need, in one pipeline; the new sessions' records in a second (before their processes start, so a session's own
fenced writes come after it); events, counters and final records queue on the tick's writes, written at its end.
One failed action does not stop the others (a failed bulk call fails the actions it answers, each logged;
dispatch errors fail one); a refused fenced write (LeaderLost) ends the term.

What each action kind does with its answers is a method looked up by kind (`_settle`); lends are settled together
by `start_sessions`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import Event, GpuState, Lease, SessionInfo, StateError
from tailspec.scheduler.idle import Action, IdleDetector
from tailspec.scheduler.leases import LeaderLost, Leases
from tailspec.scheduler.session_process import SessionContext
from tailspec.scheduler.tick_writes import TickWrites

# The scheduler loop's logger: the lessor's warnings are lines of the loop's log.
log = logging.getLogger("tailspec.scheduler.service")

FAILED_BACKOFF_S = 5.0  # a GPU whose session failed is not lent again for this long

Settle = Callable[[Action, float, list[Any], set[str]], None]


@dataclass
class Lessor:
    """The leases of one scheduler's term. `live` (session id → node, GPU, lease token) is the scheduler's own
    map, kept current here as sessions start and stop; `bad` and `failed` count a payload that does not decode
    and an action that failed on the scheduler (its `bad_payloads` and `errors`)."""

    cfg: TailspecConfig
    r: Any
    leases: Leases
    dispatcher: Any
    detector: IdleDetector
    writes: TickWrites  # the tick's events, status history and final records, written at its end
    live: dict[str, tuple[str, int, int]]
    epoch: int | None
    redis_url: str  # what sessions connect to
    require_heartbeat: bool
    bad: Callable[[str, Exception], None]
    failed: Callable[[], None]
    counts: collections.Counter[str] = field(default_factory=collections.Counter)  # this tick's increments
    last_renew: float = float("-inf")

    def __post_init__(self) -> None:
        self.c = self.cfg.cluster.name
        self._settle: dict[str, Settle] = {
            "idle": self._gpu_idle,
            "revoke": self._revoked,
            "reclaimed": self._reclaimed,
        }

    def _event(self, kind: str, node: str | None, gpu: int | None, **detail: Any) -> None:
        ev = Event(kind=kind, node=node, gpu=gpu, detail=detail)  # type: ignore[arg-type]
        self.writes.append(state.key(self.c, "events"), state.encode(ev))

    # -- one tick's actions -----------------------------------------------------------------------------
    def execute(self, actions: list[Action], now: float, pipe: Any) -> None:
        pre = self.r.pipeline(transaction=False)
        lease_calls = self._queue_leases(actions, pre)
        records = [state.key(self.c, "session", session_id=a.session_id)
                   if a.kind in ("revoke", "reclaimed") and a.session_id is not None else None for a in actions]
        wanted = [k for k in records if k is not None]
        if wanted:
            pre.mget(wanted)
        try:
            results = pre.execute(raise_on_error=False) if pre.command_stack else []
        except LeaderLost:
            raise
        except Exception as e:  # Redis down: no action can go on; the detector's state is kept as it decided
            self.failed()
            log.warning("scheduler: %d actions failed: %s", len(actions), e)
            return
        answers: dict[int, Any] = {}  # action index → its lease script's answer
        for (kind, idx), out in zip(lease_calls, results):
            answers.update(zip(idx, self.leases.answers(out, len(idx))))
        raw_records = iter(results[-1] if wanted and not isinstance(results[-1], Exception) else [None] * len(wanted))
        ended = self.dispatcher.poll() if any(a.kind == "reclaimed" for a in actions) else set()
        lends: list[tuple[Action, Lease]] = []
        for i, (a, k) in enumerate(zip(actions, records)):
            res = [answers[i]] if i in answers else []
            if k is not None:
                res.append(next(raw_records))
            try:
                if a.kind == "lend":
                    lease = self.leases.granted(res[0], a.node, a.gpu, self.epoch)
                    if lease is not None:  # else someone else's lease is still live (expires within one TTL)
                        lends.append((a, lease))
                else:
                    self._settle[a.kind](a, now, res, ended)
            except LeaderLost:
                raise
            except Exception as e:
                self.failed()
                log.warning("scheduler: %s on %s:%d failed: %s", a.kind, a.node, a.gpu, e)
        if lends:
            self.start_sessions(lends, now, pipe)
        for name, v in self.counts.items():  # one HINCRBYFLOAT per counter per tick, not one per action
            pipe.hincrbyfloat(state.key(self.c, "counters"), name, v)
        self.counts.clear()

    def _queue_leases(self, actions: list[Action], pre: Any) -> list[tuple[str, list[int]]]:
        """One bulk lease call per kind on `pre` (lends acquire, revokes revoke, reclaims with a token release);
        returns each call's kind and the indices of the actions it answers, in the order queued."""
        idx: dict[str, list[int]] = {"lend": [], "revoke": [], "reclaimed": []}
        for i, a in enumerate(actions):
            if a.kind in ("lend", "revoke") or (a.kind == "reclaimed" and a.token is not None):
                idx[a.kind].append(i)
        sc = self.cfg.scheduler
        calls = []
        if idx["lend"]:
            self.leases.acquire_many([(actions[i].node, actions[i].gpu) for i in idx["lend"]], f"scheduler@{self.c}",
                                     sc.lease_ttl_s, self.epoch, pre)
            calls.append(("lend", idx["lend"]))
        if idx["revoke"]:
            self.leases.revoke_many([(actions[i].node, actions[i].gpu, actions[i].token) for i in idx["revoke"]],
                                    max(60.0, 10 * sc.lease_ttl_s), self.epoch, pre)
            calls.append(("revoke", idx["revoke"]))
        if idx["reclaimed"]:
            self.leases.release_many([(actions[i].node, actions[i].gpu, actions[i].token) for i in idx["reclaimed"]],
                                     pre)
            calls.append(("reclaimed", idx["reclaimed"]))
        return calls

    # -- settled with the answers: `res` holds the lease script's result, then the session's record ----------
    def _gpu_idle(self, a: Action, now: float, res: list[Any], ended: set[str]) -> None:
        self._event("gpu_idle", a.node, a.gpu, detect_latency_s=a.latency_s)

    def _revoked(self, a: Action, now: float, res: list[Any], ended: set[str]) -> None:
        self.leases.revoked(res[0], a.node, a.gpu, self.epoch)
        if a.session_id is not None and self._still_starting(a.session_id, res[1]):
            # Not training yet (still importing / loading): nothing to save, cancel it now
            # instead of waiting for a lease check it has not reached (see LocalDispatcher.cancel).
            self.dispatcher.cancel(a.session_id)
        self.counts["sessions_preempted"] += 1
        self._event("lease_revoked", a.node, a.gpu, token=a.token, session_id=a.session_id, reason=a.reason)

    def _reclaimed(self, a: Action, now: float, res: list[Any], ended: set[str]) -> None:
        sid = a.session_id
        if a.token is not None and isinstance(res[0], Exception):
            log.warning("scheduler: release of %s:%d failed: %s (the lease expires within one TTL)",
                        a.node, a.gpu, res[0])
        if sid is None:
            return
        exited = sid in ended
        if not exited:
            self.dispatcher.stop(sid)  # past the deadline: the backstop
        exit_code = self.dispatcher.ended.get(sid)
        if exit_code and a.reason == "session ended":
            # It failed on its own while the GPU was still idle: do not restart it in a tight loop.
            self.detector.back_off(a.node, a.gpu, now + FAILED_BACKOFF_S)
            self._event("session_failed", a.node, a.gpu, session_id=sid, exit_code=exit_code)
        self.dispatcher.forget(sid)
        self.live.pop(sid, None)
        self.counts["sessions_stopped"] += 1
        info = self._record(sid, res[-1])
        self.finalize_record(sid, a.reason, info, queued=True)
        self._note_memory(sid, a, info)
        self._event("session_stopped", a.node, a.gpu, session_id=sid, token=a.token, reason=a.reason,
                    release_latency_s=a.latency_s, exited=exited)

    # -- lends: records first, then the processes ----------------------------------------------------------
    def start_sessions(self, lends: list[tuple[Action, Lease]], now: float, pipe: Any) -> None:
        started = self._write_start_records(lends)
        if not started:
            return
        config = self.cfg.model_dump(mode="json")
        sids: list[str] = []  # added to the sessions set with one SADD
        for a, lease, sid, info in started:
            try:
                self.dispatcher.start(self._context(a, lease, sid, config))
            except Exception as e:
                self._start_failed(a, lease, sid, info, e, now, pipe)
                continue
            self.detector.lent(a.node, a.gpu, lease.token, sid, now)
            self.live[sid] = (a.node, a.gpu, lease.token)
            sids.append(sid)
            self.counts["sessions_started"] += 1
            m = self.detector.machine(a.node, a.gpu)
            self._event("lease_granted", a.node, a.gpu, token=lease.token, session_id=sid, reason=a.reason,
                        idle_s=now - (m.drained_at or now))
            self._event("session_started", a.node, a.gpu, session_id=sid, token=lease.token)
        if sids:
            pipe.sadd(state.key(self.c, "sessions"), *sids)

    def _write_start_records(self, lends: list[tuple[Action, Lease]]) -> list[tuple[Action, Lease, str, SessionInfo]]:
        """Each lend's "starting" session record, in one round trip; on failure the GPUs go back (lent again at
        a later tick) and nothing starts."""
        started = []
        records: dict[str, bytes] = {}
        for a, lease in lends:
            sid = f"{a.node}-g{a.gpu}-t{lease.token}"
            info = SessionInfo(session_id=sid, node=a.node, gpu=a.gpu, lease_token=lease.token, status="starting",
                               started_at=lease.granted_at)
            records[state.key(self.c, "session", session_id=sid)] = state.encode(info)
            started.append((a, lease, sid, info))
        try:
            self.r.mset(records)  # one command for every lend of the tick
        except Exception as e:
            self.failed()
            log.warning("scheduler: %d session records not written: %s", len(lends), e)
            for a, lease in lends:
                try:
                    self.leases.release(a.node, a.gpu, lease.token)
                except Exception:
                    pass  # expires within one TTL
            return []
        return started

    def _context(self, a: Action, lease: Lease, sid: str, config: dict[str, Any]) -> SessionContext:
        sc = self.cfg.scheduler
        return SessionContext(
            session_id=sid,
            node=a.node,
            gpu=a.gpu,
            lease_token=lease.token,
            redis_url=self.redis_url,
            cluster=self.c,
            config=config,
            lease_ttl_s=sc.lease_ttl_s,
            stop_deadline_s=sc.stop_deadline_s,
            started_at=lease.granted_at,
            require_heartbeat=self.require_heartbeat,
        )

    def _start_failed(self, a: Action, lease: Lease, sid: str, info: SessionInfo, e: Exception, now: float,
                      pipe: Any) -> None:
        self.failed()
        log.warning("scheduler: lend on %s:%d failed: %s", a.node, a.gpu, e)
        try:
            self.leases.release(a.node, a.gpu, lease.token)
            self.write_stopped(sid, info, "failed", f"start: {e}", queued=False)
        except Exception:
            pass  # the lease expires within one TTL
        pipe.sadd(state.key(self.c, "sessions"), sid)
        self._event("session_failed", a.node, a.gpu, session_id=sid, error=str(e))
        self.detector.back_off(a.node, a.gpu, now + FAILED_BACKOFF_S)

    # -- renewals and the clean exit's revokes -------------------------------------------------------------
    def renew(self, now: float, pipe: Any) -> None:
        """Every quarter TTL, the leases of the lent GPUs, on `pipe` in one command: the sessions renew their own,
        but one whose process is still starting (imports, model load) must not lose its GPU before its first
        renewal. Fenced by each lease's epoch: refused once this term is over."""
        ttl = self.cfg.scheduler.lease_ttl_s
        if now - self.last_renew < ttl / 4:
            return
        self.last_renew = now
        machines = self.detector.machines
        lent = [(k[0], k[1], machines[k].lease_token) for k in self.detector.keys_in(GpuState.LENT)
                if machines[k].lease_token is not None]
        lent.sort(key=lambda x: self.detector.index.order[(x[0], x[1])])
        if lent:
            self.leases.renew_many(lent, ttl, require_heartbeat=False, client=pipe)

    def revoke_live(self) -> None:
        """A clean exit: every live session's lease revoked (a deposed term's revokes are refused, and a lease
        Redis cannot be reached for expires within one TTL anyway)."""
        for node, gpu, token in list(self.live.values()):
            try:
                self.leases.revoke(node, gpu, token, epoch=self.epoch)
            except Exception:
                pass

    # -- session records -----------------------------------------------------------------------------------
    def write_stopped(self, sid: str, info: SessionInfo, status: str, reason: str, queued: bool) -> None:
        """The one writer of a session's final record on the scheduler's side (status, when, why); `queued`: with
        the tick's other records in one MSET at its end, else now."""
        data = state.encode(info.model_copy(update={"status": status, "stopped_at": time.time(),
                                                    "stop_reason": reason}))
        key = state.key(self.c, "session", session_id=sid)
        if queued:
            self.writes.set(key, data)
        else:
            self.r.execute_command("SET", key, data)  # set() inspects its arguments on every call

    def finalize_record(self, sid: str, reason: str, info: SessionInfo | None = None, queued: bool = False) -> None:
        """A session killed before writing its final record is marked stopped by us. `info`: its record as read
        this tick (read here when not given and not `queued`); `queued`: the write goes with the tick's writes."""
        if info is None and not queued:
            try:
                info = state.get(self.r, state.key(self.c, "session", session_id=sid), SessionInfo)
            except StateError:
                info = None
        if info is not None and info.status not in ("stopped", "failed"):
            self.write_stopped(sid, info, "stopped", f"scheduler: {reason}", queued)

    def _record(self, sid: str, raw: Any) -> SessionInfo | None:
        if raw is None or isinstance(raw, Exception):
            return None
        try:
            return state.decode(SessionInfo, raw, where=f"session:{sid}")
        except StateError as e:
            self.bad(f"session:{sid}", e)
            return None

    def _still_starting(self, sid: str, raw: Any) -> bool:
        info = self._record(sid, raw)
        return info is not None and info.status == "starting"

    def _note_memory(self, sid: str, a: Action, info: SessionInfo | None) -> None:
        """The memory handshake, scheduler side: a session's computed footprint raises the free memory a GPU
        needs to be lent (IdleDetector.learn_need), and a session that declined is counted and logged."""
        if info is None:
            return
        if info.mem_needed:
            self.detector.learn_need(info.mem_needed)
        if info.declined:
            self.counts["sessions_declined"] += 1
            self._event("session_declined", a.node, a.gpu, session_id=sid, reason=info.stop_reason,
                        mem_needed=info.mem_needed, mem_free=info.mem_free)
