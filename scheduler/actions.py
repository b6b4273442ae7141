"""One tick's actions executed by the leading scheduler, in a fixed number of round trips and commands however
many GPUs they concern: one bulk lease script per kind (every lend's acquire, every revoke, every release) and
one MGET of the session records they need, in one pipeline; the new sessions' records in a second (before their
processes start, so a session's own fenced writes come after it); events, counters and final records queue on
the tick's pipeline, written at its end. One failed action does not stop the others (a failed bulk call fails
the actions it answers, each logged; dispatch errors fail one); a refused fenced write (LeaderLost) ends the term.

What each action kind does with its answers is a small function looked up by kind (SETTLE); lends are settled
together by `start_sessions`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tailspec.core import state
from tailspec.core.state import Lease, SessionInfo, StateError
from tailspec.scheduler.idle import Action
from tailspec.scheduler.leases import LeaderLost
from tailspec.scheduler.session_process import SessionContext

if TYPE_CHECKING:  # the scheduler calls these functions with itself
    from tailspec.scheduler.service import Scheduler

log = logging.getLogger("tailspec.scheduler.service")

FAILED_BACKOFF_S = 5.0  # a GPU whose session failed is not lent again for this long


def execute_all(s: Scheduler, actions: list[Action], now: float, pipe: Any) -> None:
    pre = s.r.pipeline(transaction=False)
    lease_calls = _queue_leases(s, actions, pre)
    records = [state.key(s.c, "session", session_id=a.session_id)
               if a.kind in ("revoke", "reclaimed") and a.session_id is not None else None for a in actions]
    wanted = [k for k in records if k is not None]
    if wanted:
        pre.mget(wanted)
    try:
        results = pre.execute(raise_on_error=False) if pre.command_stack else []
    except LeaderLost:
        raise
    except Exception as e:  # Redis down: no action can go on; the detector's state is kept as it decided
        s.errors += 1
        log.warning("scheduler: %d actions failed: %s", len(actions), e)
        return
    answers: dict[int, Any] = {}  # action index → its lease script's answer
    for (kind, idx), out in zip(lease_calls, results):
        answers.update(zip(idx, s.leases.answers(out, len(idx))))
    raw_records = iter(results[-1] if wanted and not isinstance(results[-1], Exception) else [None] * len(wanted))
    ended = s.dispatcher.poll() if any(a.kind == "reclaimed" for a in actions) else set()
    lends: list[tuple[Action, Lease]] = []
    for i, (a, k) in enumerate(zip(actions, records)):
        res = [answers[i]] if i in answers else []
        if k is not None:
            res.append(next(raw_records))
        try:
            if a.kind == "lend":
                lease = s.leases.granted(res[0], a.node, a.gpu, s.epoch)
                if lease is not None:  # else someone else's lease is still live (expires within one TTL)
                    lends.append((a, lease))
            else:
                SETTLE[a.kind](s, a, now, res, ended, pipe)
        except LeaderLost:
            raise
        except Exception as e:
            s.errors += 1
            log.warning("scheduler: %s on %s:%d failed: %s", a.kind, a.node, a.gpu, e)
    if lends:
        start_sessions(s, lends, now, pipe)
    for name, v in s._counts.items():  # one HINCRBYFLOAT per counter per tick, not one per action
        pipe.hincrbyfloat(state.key(s.c, "counters"), name, v)
    s._counts.clear()


def _queue_leases(s: Scheduler, actions: list[Action], pre: Any) -> list[tuple[str, list[int]]]:
    """One bulk lease call per kind on `pre` (lends acquire, revokes revoke, reclaims with a token release);
    returns each call's kind and the indices of the actions it answers, in the order queued."""
    idx: dict[str, list[int]] = {"lend": [], "revoke": [], "reclaimed": []}
    for i, a in enumerate(actions):
        if a.kind in ("lend", "revoke") or (a.kind == "reclaimed" and a.token is not None):
            idx[a.kind].append(i)
    sc = s.cfg.scheduler
    calls = []
    if idx["lend"]:
        s.leases.acquire_many([(actions[i].node, actions[i].gpu) for i in idx["lend"]], f"scheduler@{s.c}",
                              sc.lease_ttl_s, s.epoch, pre)
        calls.append(("lend", idx["lend"]))
    if idx["revoke"]:
        s.leases.revoke_many([(actions[i].node, actions[i].gpu, actions[i].token) for i in idx["revoke"]],
                             max(60.0, 10 * sc.lease_ttl_s), s.epoch, pre)
        calls.append(("revoke", idx["revoke"]))
    if idx["reclaimed"]:
        s.leases.release_many([(actions[i].node, actions[i].gpu, actions[i].token) for i in idx["reclaimed"]],
                              pre)
        calls.append(("reclaimed", idx["reclaimed"]))
    return calls


# -- settled with the answers: `res` holds the lease script's result, then the session's record ----
def _gpu_idle(s: Scheduler, a: Action, now: float, res: list[Any], ended: set[str], pipe: Any) -> None:
    s._event("gpu_idle", a.node, a.gpu, pipe, detect_latency_s=a.latency_s)


def _revoked(s: Scheduler, a: Action, now: float, res: list[Any], ended: set[str], pipe: Any) -> None:
    s.leases.revoked(res[0], a.node, a.gpu, s.epoch)
    if a.session_id is not None and _still_starting(s, a.session_id, res[1]):
        # Not training yet (still importing / loading): nothing to save, cancel it now
        # instead of waiting for a lease check it has not reached (see LocalDispatcher.cancel).
        s.dispatcher.cancel(a.session_id)
    s._counts["sessions_preempted"] += 1
    s._event("lease_revoked", a.node, a.gpu, pipe, token=a.token, session_id=a.session_id, reason=a.reason)


def _reclaimed(s: Scheduler, a: Action, now: float, res: list[Any], ended: set[str], pipe: Any) -> None:
    sid = a.session_id
    if a.token is not None and isinstance(res[0], Exception):
        log.warning("scheduler: release of %s:%d failed: %s (the lease expires within one TTL)",
                    a.node, a.gpu, res[0])
    if sid is None:
        return
    exited = sid in ended
    if not exited:
        s.dispatcher.stop(sid)  # past the deadline: the backstop
    exit_code = s.dispatcher.ended.get(sid)
    if exit_code and a.reason == "session ended":
        # It failed on its own while the GPU was still idle: do not restart it in a tight loop.
        s.detector.back_off(a.node, a.gpu, now + FAILED_BACKOFF_S)
        s._event("session_failed", a.node, a.gpu, pipe, session_id=sid, exit_code=exit_code)
    s.dispatcher.forget(sid)
    s.live.pop(sid, None)
    s._counts["sessions_stopped"] += 1
    info = _record(s, sid, res[-1])
    finalize_record(s, sid, a.reason, info, pipe)
    _note_memory(s, sid, a, info, pipe)
    s._event("session_stopped", a.node, a.gpu, pipe, session_id=sid, token=a.token, reason=a.reason,
             release_latency_s=a.latency_s, exited=exited)


SETTLE: dict[str, Callable[[Scheduler, Action, float, list[Any], set[str], Any], None]] = {
    "idle": _gpu_idle,
    "revoke": _revoked,
    "reclaimed": _reclaimed,
}


# -- lends: records first, then the processes --------------------------------------------------------
def start_sessions(s: Scheduler, lends: list[tuple[Action, Lease]], now: float, pipe: Any) -> None:
    started = _write_start_records(s, lends)
    if not started:
        return
    config = s.cfg.model_dump(mode="json")
    sids: list[str] = []  # added to the sessions set with one SADD
    for a, lease, sid, info in started:
        try:
            s.dispatcher.start(_context(s, a, lease, sid, config))
        except Exception as e:
            _start_failed(s, a, lease, sid, info, e, now, pipe)
            continue
        s.detector.lent(a.node, a.gpu, lease.token, sid, now)
        s.live[sid] = (a.node, a.gpu, lease.token)
        sids.append(sid)
        s._counts["sessions_started"] += 1
        m = s.detector.machine(a.node, a.gpu)
        s._event("lease_granted", a.node, a.gpu, pipe, token=lease.token, session_id=sid, reason=a.reason,
                 idle_s=now - (m.drained_at or now))
        s._event("session_started", a.node, a.gpu, pipe, session_id=sid, token=lease.token)
    if sids:
        pipe.sadd(state.key(s.c, "sessions"), *sids)


def _write_start_records(
    s: Scheduler, lends: list[tuple[Action, Lease]]
) -> list[tuple[Action, Lease, str, SessionInfo]]:
    """Each lend's "starting" session record, in one round trip; on failure the GPUs go back (lent again at
    a later tick) and nothing starts."""
    started = []
    records: dict[str, bytes] = {}
    for a, lease in lends:
        sid = f"{a.node}-g{a.gpu}-t{lease.token}"
        info = SessionInfo(session_id=sid, node=a.node, gpu=a.gpu, lease_token=lease.token, status="starting",
                           started_at=lease.granted_at)
        records[state.key(s.c, "session", session_id=sid)] = state.encode(info)
        started.append((a, lease, sid, info))
    try:
        s.r.mset(records)  # one command for every lend of the tick
    except Exception as e:
        s.errors += 1
        log.warning("scheduler: %d session records not written: %s", len(lends), e)
        for a, lease in lends:
            try:
                s.leases.release(a.node, a.gpu, lease.token)
            except Exception:
                pass  # expires within one TTL
        return []
    return started


def _context(s: Scheduler, a: Action, lease: Lease, sid: str, config: dict[str, Any]) -> SessionContext:
    sc = s.cfg.scheduler
    return SessionContext(
        session_id=sid,
        node=a.node,
        gpu=a.gpu,
        lease_token=lease.token,
        redis_url=s.redis_url or s.cfg.cluster.redis_url,
        cluster=s.c,
        config=config,
        lease_ttl_s=sc.lease_ttl_s,
        stop_deadline_s=sc.stop_deadline_s,
        started_at=lease.granted_at,
        require_heartbeat=s.require_heartbeat,
    )


def _start_failed(
    s: Scheduler, a: Action, lease: Lease, sid: str, info: SessionInfo, e: Exception, now: float, pipe: Any
) -> None:
    s.errors += 1
    log.warning("scheduler: lend on %s:%d failed: %s", a.node, a.gpu, e)
    try:
        s.leases.release(a.node, a.gpu, lease.token)
        write_stopped(s, sid, info, "failed", f"start: {e}", s.r)
    except Exception:
        pass  # the lease expires within one TTL
    pipe.sadd(state.key(s.c, "sessions"), sid)
    s._event("session_failed", a.node, a.gpu, pipe, session_id=sid, error=str(e))
    s.detector.back_off(a.node, a.gpu, now + FAILED_BACKOFF_S)


# -- session records -------------------------------------------------------------------------------
def write_stopped(s: Scheduler, sid: str, info: SessionInfo, status: str, reason: str, client: Any) -> None:
    """The one writer of a session's final record on the scheduler's side (status, when, why); `client`: Redis,
    or a pipeline: then the record goes with the tick's other records in one MSET at its end."""
    data = state.encode(info.model_copy(update={"status": status, "stopped_at": time.time(), "stop_reason": reason}))
    key = state.key(s.c, "session", session_id=sid)
    if client is s.r:
        client.execute_command("SET", key, data)  # set() inspects its arguments on every call
    else:
        s._writes.set(key, data)


def finalize_record(s: Scheduler, sid: str, reason: str, info: SessionInfo | None = None, pipe: Any = None) -> None:
    """A session killed before writing its final record is marked stopped by us. `info`: its record as read
    this tick (read here when not given); `pipe`: where to queue the write (written now when not given)."""
    if info is None and pipe is None:
        try:
            info = state.get(s.r, state.key(s.c, "session", session_id=sid), SessionInfo)
        except StateError:
            info = None
    if info is not None and info.status not in ("stopped", "failed"):
        write_stopped(s, sid, info, "stopped", f"scheduler: {reason}", s.r if pipe is None else pipe)


def _record(s: Scheduler, sid: str, raw: Any) -> SessionInfo | None:
    if raw is None or isinstance(raw, Exception):
        return None
    try:
        return state.decode(SessionInfo, raw, where=f"session:{sid}")
    except StateError as e:
        s._bad(f"session:{sid}", e)
        return None


def _still_starting(s: Scheduler, sid: str, raw: Any) -> bool:
    info = _record(s, sid, raw)
    return info is not None and info.status == "starting"


def _note_memory(s: Scheduler, sid: str, a: Action, info: SessionInfo | None, pipe: Any) -> None:
    """The memory handshake, scheduler side: a session's computed footprint raises the free memory a GPU
    needs to be lent (IdleDetector.learn_need), and a session that declined is counted and logged."""
    if info is None:
        return
    if info.mem_needed:
        s.detector.learn_need(info.mem_needed)
    if info.declined:
        s._counts["sessions_declined"] += 1
        s._event("session_declined", a.node, a.gpu, pipe, session_id=sid, reason=info.stop_reason,
                 mem_needed=info.mem_needed, mem_free=info.mem_free)
