"""What a trainer session sees of the scheduler: `SessionContext`, and the process entry that runs one.

The scheduler starts a session process (local subprocess or Ray actor) with the GPU exposed through
CUDA_VISIBLE_DEVICES and the context as JSON in $TAILSPEC_SESSION_CONTEXT (never pickle). The process
imports the session entry config names (`scheduler.session_entry`, "module:attribute"), an object with the
`SessionEntry` protocol declared here, and calls `entry.run(ctx)`; it trains while `ctx.should_continue()` is
True and returns when it turns False. The scheduler knows no models: the roof implements the protocol
(tailspec/session_entry.py) and names it in config, so no import arrow points up.

The lease is kept off the session's step path: `SessionContext.keeper` (scheduler/lease_keeper.py) renews it with
its fencing token on a thread of its own, from the session's start (`run_context`, or the first
`should_continue()`), and listens for its revocation, which the scheduler pushes. `should_continue()` reads that
thread's local flag — no Redis round trip — so a session may call it before every layer of a forward. It turns
False — for good — when the revocation is pushed, the token is stale, the lease was revoked or expired, the
scheduler's heartbeat is gone, or no renewal has succeeded for three quarters of a TTL (Redis unreachable, the
renewal thread stuck). So whatever dies (scheduler, Redis, network, the renewal thread), a session stops within
one lease TTL on its own, before Redis lets its lease lapse; its fenced writes are refused after that anyway.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import redis
from tailspec.core import state
from tailspec.core.config import SchedulerConfig, TailspecConfig
from tailspec.core.state import PhaseInfo, SessionInfo
from tailspec.scheduler import leases as L
from tailspec.scheduler.cpu_quota import CGROUP_ENV
from tailspec.scheduler.lease_keeper import LeaseKeeper
from tailspec.scheduler.placement import CPUS_ENV, place_from_env, unplace
from tailspec.scheduler.warm_wait import WarmWait

CONTEXT_ENV = "TAILSPEC_SESSION_CONTEXT"
NICE_ENV = "TAILSPEC_SESSION_NICE"


@dataclass
class SessionContext:
    session_id: str
    node: str
    gpu: int
    lease_token: int
    redis_url: str
    cluster: str
    config: dict[str, Any] = field(default_factory=dict)  # TailspecConfig.model_dump(mode="json")
    lease_ttl_s: float = 2.0
    stop_deadline_s: float = 1.0  # after revoke, the GPU counts as reclaimed after this long
    started_at: float = field(default_factory=time.time)
    require_heartbeat: bool = True
    renew_every_s: float = 0.0  # the renewal thread's period; 0: a quarter of lease_ttl_s

    def __post_init__(self) -> None:
        self._r: Any = None
        self._leases: Any = None
        self._keeper: LeaseKeeper | None = None
        self._stopped = False
        self.stop_reason: str | None = None
        self.stop_seen_at: float | None = None  # wall time should_continue() first returned False
        self.mem_needed: int | None = None  # what the session computed it needs (memory handshake)
        self.mem_free: int | None = None
        self.declined = False
        self.released_at: float | None = None  # wall time the session freed its GPU (release)

    # -- serialisation (JSON only) --------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> "SessionContext":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"session context is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("session context must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"session context has unknown fields: {sorted(unknown)}")
        return cls(**data)

    def phase(self):
        """The cluster's current PhaseInfo (policy version and policy_path for the teacher), or None."""
        try:
            return state.get(self.redis, state.key(self.cluster, "phase"), PhaseInfo)
        except Exception:
            return None

    def tailspec_config(self):
        """The full TailspecConfig the scheduler ran with."""
        return TailspecConfig.model_validate(self.config)

    # -- Redis --------------------------------------------------------------------------------
    @property
    def redis(self) -> Any:
        if self._r is None:
            # Short timeouts: a hung Redis must not stall a training step for long.
            t = max(0.05, min(0.25, self.lease_ttl_s / 8))
            self._r = redis.Redis.from_url(self.redis_url, socket_timeout=t, socket_connect_timeout=t)
        return self._r

    @property
    def leases(self):
        if self._leases is None:
            self._leases = L.Leases(self.redis, self.cluster)
        return self._leases

    @property
    def keeper(self) -> LeaseKeeper:
        """The session's lease keeper (the module doc); its thread starts with `start_renewals()`."""
        if self._keeper is None:
            self._keeper = LeaseKeeper(self.leases, self.redis, self.node, self.gpu, self.lease_token,
                                       self.lease_ttl_s, self.require_heartbeat, self.renew_every_s)
        return self._keeper

    def start_renewals(self) -> None:
        """Start the lease's renewal thread (once; `should_continue()` starts it too if nobody did)."""
        self.keeper.start()

    def close(self) -> None:
        """Stop renewing the lease (the session has ended). Returns at once; the thread ends on its own."""
        if self._keeper is not None:
            self._keeper.close()

    def _stop(self, reason: str) -> bool:
        if not self._stopped:
            self._stopped = True
            self.stop_reason = reason
            self.stop_seen_at = time.time()
        return False

    def should_continue(self) -> bool:
        """True while this session still holds its GPU: a read of the renewal thread's local flag, never a round
        trip (the module doc). Sticky once False."""
        if self._stopped:
            return False
        keeper = self.keeper
        if not keeper.running:
            keeper.start()
        if keeper.holds():
            return True
        return self._stop(keeper.reason or "stopped")

    def decline(self, reason: str, mem_needed: int | None = None, mem_free: int | None = None) -> None:
        """Give the GPU back without using it (e.g. the session does not fit in its free memory): the lease is
        released at once, the final record says why (status stopped, `declined`), and the scheduler sees the
        process end at its next tick. The entry function returns right after calling this."""
        self.declined = True
        self.mem_needed, self.mem_free = mem_needed, mem_free
        self._stop(f"declined: {reason}")
        self.keeper.stop(f"declined: {reason}")
        self.close()
        try:
            self.leases.release(self.node, self.gpu, self.lease_token)
        except Exception:  # Redis down: the lease expires within one TTL anyway
            pass

    def release(self) -> None:
        """The session has freed its GPU and trains no more; what is left (its last merge, from host memory, and
        its exit) does not need the GPU. The record says so (status stopping, `released_at`): the trainer's
        `wait_reclaimed` counts the GPU back from here. The scheduler still counts it reclaimed when the process
        ends, and lends it again only then. Never raises."""
        self.released_at = time.time()
        k = state.key(self.cluster, "session", session_id=self.session_id)
        try:
            prev = state.get(self.redis, k, SessionInfo)
            if prev is not None and prev.status in ("stopped", "failed"):
                return  # the scheduler wrote the end already (e.g. the deadline passed): leave it
            info = self._info("stopping", prev)
            # the session's own record, written when the lease may be gone already: not fenced, as the final one
            state.put(self.redis, k, info)
        except Exception:  # Redis down: the trainer waits for the final record (or its timeout) instead
            pass

    def _info(self, status: str, prev: SessionInfo | None, **kw: Any) -> SessionInfo:
        return SessionInfo(
            session_id=self.session_id, node=self.node, gpu=self.gpu, lease_token=self.lease_token, status=status,
            step=prev.step if prev else 0, loss=prev.loss if prev else None, tokens=prev.tokens if prev else 0,
            started_at=self.started_at, drafter_version=prev.drafter_version if prev else None, pid=os.getpid(),
            released_at=self.released_at, **kw)

    def report(
        self, step: int, loss: float | None = None, tokens: int = 0, drafter_version: int | None = None
    ) -> bool:
        """Publish progress (fenced: refused by Redis once the lease is gone; not sent once the keeper has seen it
        go). Never raises on Redis errors."""
        if self._keeper is not None and not self._keeper.holds():
            return False
        info = SessionInfo(
            session_id=self.session_id,
            node=self.node,
            gpu=self.gpu,
            lease_token=self.lease_token,
            status="running" if self.released_at is None else "stopping",
            step=step,
            loss=None if loss is None or loss != loss else float(loss),
            tokens=tokens,
            started_at=self.started_at,
            drafter_version=drafter_version,
            pid=os.getpid(),
            released_at=self.released_at,
        )
        try:
            return self.leases.fenced_set(
                self.node,
                self.gpu,
                self.lease_token,
                state.key(self.cluster, "session", session_id=self.session_id),
                state.encode(info),
            )
        except Exception:
            return False

    def _final_record(self, status: str, reason: str) -> None:
        k = state.key(self.cluster, "session", session_id=self.session_id)
        try:
            prev = state.get(self.redis, k, SessionInfo)
        except Exception:
            prev = None
        now = time.time()
        info = self._info(status, prev, stopped_at=now, stop_reason=reason, mem_needed=self.mem_needed,
                          mem_free=self.mem_free, declined=self.declined,
                          stop_latency_s=(now - self.stop_seen_at) if self.stop_seen_at else None)
        try:
            # The session's own record, written after the lease is gone: not fenced on purpose.
            state.put(self.redis, k, info)
        except Exception:
            pass


@runtime_checkable
class SessionEntry(Protocol):
    """What a session process runs, named in config (`scheduler.session_entry`, "module:attribute"):
    `run(ctx)` the session, until `ctx.should_continue()` turns False; `warm_up()` once in a pre-started process
    (`scheduler.warm_sessions`), the first-use costs a lend would otherwise pay; `prestage()` in a warm process
    between lends, best-effort host work reading ahead what the next lend starts from (scheduler/warm_wait.py).
    A plain function named in config is accepted too, as a `FunctionEntry`: it runs the session, with nothing to
    warm up and nothing to read ahead (the small sessions of scheduler/busy_sessions.py and the tests')."""

    def run(self, ctx: SessionContext) -> object: ...

    def warm_up(self) -> None: ...

    def prestage(self) -> None: ...


@dataclass(frozen=True)
class FunctionEntry:
    """A plain function as a `SessionEntry`: `fn(ctx)` runs the session; nothing to warm up or read ahead."""

    fn: Callable[[SessionContext], object]

    def run(self, ctx: SessionContext) -> object:
        return self.fn(ctx)

    def warm_up(self) -> None:
        pass

    def prestage(self) -> None:
        pass


def load_entry(spec: str) -> SessionEntry:
    """Resolve "module:attribute" → the session entry: an object with the `SessionEntry` protocol, or a plain
    function (wrapped as a `FunctionEntry`). Anything else is a ValueError naming the value."""
    if ":" not in spec:
        raise ValueError(f"session entry {spec!r} must look like 'module:attribute'")
    mod_name, name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"session entry {spec!r}: cannot import module {mod_name!r} ({e})") from None
    obj = vars(mod).get(name)
    if obj is None:
        raise ValueError(f"session entry {spec!r}: module {mod_name!r} has no attribute {name!r}")
    if isinstance(obj, SessionEntry) and not isinstance(obj, type):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return FunctionEntry(obj)
    raise ValueError(f"session entry {spec!r}: {name!r} is {type(obj).__name__}, neither an object with "
                     "run(ctx), warm_up() and prestage() (SessionEntry) nor a function of the context")


def run_context(ctx: SessionContext, entry: str, handle_sigterm: bool = False) -> int:
    """Run one session to its end in this process; writes the final SessionInfo. Returns an exit code.
    `handle_sigterm` (own process only, not inside a Ray worker): SIGTERM leaves through the final record."""
    def _term(signum, frame):  # the dispatcher's SIGTERM after the deadline
        raise SystemExit(143)

    if handle_sigterm and threading_is_main():
        signal.signal(signal.SIGTERM, _term)
    status, reason, code = "stopped", None, 0
    try:
        session = load_entry(entry)
        ctx.start_renewals()  # the lease is kept from here, through the entry's start-up
        ctx.report(0)
        session.run(ctx)
        reason = ctx.stop_reason or "returned"
    except SystemExit as e:
        reason, code = "terminated", int(e.code or 0)
    except BaseException as e:  # noqa: BLE001 - a failing session must still leave its record
        status, reason, code = "failed", f"{type(e).__name__}: {e}", 1
        traceback.print_exc()
    finally:
        ctx.close()
        ctx._final_record(status, reason or "returned")
    return code


def threading_is_main() -> bool:
    return threading.current_thread() is threading.main_thread()


DONE_ENV = "TAILSPEC_SESSION_DONE"  # a warm process writes the session's exit code here when it ends
READY_ENV = "TAILSPEC_WARM_READY"  # a warm process creates this file when its imports are done
WARM_POLICY_ENV = "TAILSPEC_WARM_POLICY"  # scheduler.warm_policy: a policy directory warm processes build while waiting


def warm_main(spec: str) -> int:
    """A pre-started session process that serves one session after another: import the entry (torch, models —
    seconds on a busy machine) and run its `warm_up()` once, then for each line on stdin, {"env": {...},
    "context": {...}}, run that session at once and write its exit code to the file `$TAILSPEC_SESSION_DONE`
    names, then wait for the next line. The GPU is chosen per session: CUDA initialises lazily, so
    CUDA_VISIBLE_DEVICES set at the first assignment applies (on simulated GPUs only the cores change, and they
    are re-pinned per session). EOF on stdin (the dispatcher went away) ends the process; so does a session
    ended by SIGTERM. While no line comes, the entry's `prestage()` reads ahead for the next lend
    (scheduler/warm_wait.py).

    Serving many sessions matters because lends are short and frequent: a process per lend pays its imports
    per lend, seconds of CPU that a short tail does not have and that spill into the RL update."""
    entry = _warm_up(spec)
    if entry is None:
        return 2
    # Between lends the entry reads ahead on the host's share; a plain function has nothing to read ahead, so
    # its wait is a plain read of stdin.
    wait = WarmWait(None if isinstance(entry, FunctionEntry) else entry.prestage, leave=unplace)
    while True:
        line = wait.next_line()
        if not line.strip():
            return 0
        code = _serve(line, spec)
        if code is not None:
            return code


def _warm_up(spec: str) -> SessionEntry | None:
    """Import the entry and run its `warm_up()`, and say so; None if it cannot load."""
    if place_from_env():
        # Started on the cores of the GPU just lent (dispatch._refill), it imports there beside that GPU's
        # session, for seconds that can outlast the tail and spill into the RL update, whose threads span
        # every core. At nice 10 it yields most of the core to them. It cannot renice back and needs not:
        # whenever it is handed a session, that GPU's rollout worker has drained and the cores are its own.
        try:
            os.nice(REFILL_NICE)
        except OSError:
            pass
    try:
        entry = load_entry(spec)
        entry.warm_up()  # the first-use costs a lend would otherwise pay
    except ValueError as e:
        print(f"tailspec warm session: {e}", file=sys.stderr)
        return None
    ready = os.environ.get(READY_ENV)
    if ready:  # imports done (scheduler.dispatch.warm_ready counts these)
        with open(ready, "w"):
            pass
    return entry


def _serve(line: str, entry: str) -> int | None:
    """Run the session one stdin line assigns; the process's exit code when it must end, else None."""
    try:
        msg = json.loads(line)
        env = {str(k): str(v) for k, v in dict(msg["env"]).items()}
        ctx = SessionContext.from_json(json.dumps(msg["context"]))
    except (ValueError, KeyError, TypeError) as e:
        print(f"tailspec warm session: bad assignment: {e}", file=sys.stderr)
        return 2
    os.environ.pop(CPUS_ENV, None)
    os.environ.pop(CGROUP_ENV, None)
    os.environ.pop(DONE_ENV, None)
    os.environ.update(env)
    _renice()
    if CPUS_ENV in env:
        place_from_env()  # the assigned GPU's cores
    else:
        unplace()
    print(f"tailspec session {ctx.session_id} on {ctx.node}:gpu{ctx.gpu}", flush=True)
    code = run_context(ctx, entry, handle_sigterm=True)
    done = env.get(DONE_ENV)
    if done:
        tmp = done + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(code))
        os.replace(tmp, done)  # whole or absent
    if code == 143 or not done:  # terminated by the dispatcher, or a dispatcher that expects an exit
        return code
    return None


_reniced = False


def _renice() -> None:
    # When a session is assigned, not before: a warm process imports at normal priority (at a high niceness it
    # starves behind busy rollout workers and is still importing when its GPU is lent). Lowering one's own
    # priority needs no privileges; it cannot be raised back, so it stays for the sessions that follow.
    global _reniced
    n = os.environ.get(NICE_ENV, "")
    if n.isdigit() and int(n) > 0 and not _reniced:  # os.nice adds: once per process
        _reniced = True
        try:
            os.nice(int(n))
        except OSError as e:
            print(f"tailspec session: could not set niceness {n}: {e}", file=sys.stderr)


REFILL_NICE = 10


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--warm":
        return warm_main(sys.argv[2])
    _renice()
    place_from_env()
    raw = os.environ.get(CONTEXT_ENV)
    if not raw:
        print(f"tailspec session: ${CONTEXT_ENV} is not set", file=sys.stderr)
        return 2
    ctx = SessionContext.from_json(raw)
    entry = os.environ.get("TAILSPEC_SESSION_ENTRY") or ctx.config.get("scheduler", {}).get(
        "session_entry", SchedulerConfig().session_entry
    )
    return run_context(ctx, entry, handle_sigterm=True)


if __name__ == "__main__":
    code = main()
    # The final record is written: leave at once instead of spending time in interpreter teardown
    # while the scheduler waits to see the GPU free.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
