"""A session's hold on its lease, kept off its step path: `LeaseKeeper`.

One thread per session renews the lease (fenced by its token, every `renew_every_s`, a quarter TTL by default)
and listens for its revocation, which the scheduler's revoke scripts PUBLISH (the token) on a channel named as
the GPU's revoke flag key (scheduler/leases.py). The session's own threads only read a local flag: `holds()` is
a `threading.Event` and a clock comparison, no Redis round trip, so a session may check it before every layer of
a forward, between micro-batches and inside a validation.

`holds()` turns False, for good, when:
- a revocation of this token is pushed (the session sees it at its next check point, a push's delivery after the
  revoke);
- a renewal answers anything but RENEWED: revoked, expired, a stale token, the scheduler's heartbeat gone, the
  leader that granted the lease deposed;
- the lease clock runs out: no renewal has succeeded for `STOP_AT` of a TTL since the last successful one was
  sent (Redis unreachable, or the renewal thread paused or stuck). Redis expires the lease a quarter TTL later,
  so the session stops before its lease lapses; its fenced writes are refused by Redis after that in any case.

The listener subscribes before the first renewal, and a revoke's flag outlives the lease (scheduler/leases.py), so
a revocation that came before the subscription is answered by that renewal.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from tailspec.scheduler import leases as L

STOP_AT = 0.75  # of a TTL since the last successful renewal was sent: the session stops there
RETRY_S = 0.05  # after a failed renewal or subscription, try again this soon (within the lease clock)


@dataclass
class LeaseKeeper:
    """Renews one lease and listens for its revocation on a thread (`start`); `holds()` reads the result.
    The lease clock starts when the keeper is made: it covers STOP_AT of a TTL until the first renewal answers."""

    leases: L.Leases
    r: Any  # the Redis client the listener subscribes with (its own connection from the client's pool)
    node: str
    gpu: int
    token: int
    ttl_s: float
    require_heartbeat: bool = True
    renew_every_s: float = 0.0  # 0: a quarter of ttl_s

    def __post_init__(self) -> None:
        self._stopped = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # The clock starts here, not at the grant: the scheduler renews a lease while its session process starts
        # (scheduler/lessor.py), and the thread's first renewal, at once, says whether the lease is still there.
        self._valid_until = time.monotonic() + STOP_AT * self.ttl_s
        self._error: str | None = None  # the last renewal's or subscription's error, until one succeeds
        self.reason: str | None = None  # why holds() turned False
        self.stopped_at: float | None = None  # wall time it did
        self.renewals = 0  # renewal round trips sent
        self.renew_wall_s = 0.0  # their wall time, on this thread
        self.cpu_s = 0.0  # the thread's CPU time so far (what it takes beside the session's step)
        self.pushed = False  # the stop came by a pushed revocation

    @property
    def channel(self) -> str:
        """Where the scheduler publishes this GPU's revocations: the name of its revoke flag key."""
        return self.leases.revoke_channel(self.node, self.gpu)

    # -- the session's side: local reads only ---------------------------------------------------------------
    def holds(self) -> bool:
        """True while the session still holds its GPU (the module doc). Never a round trip."""
        if self._stopped.is_set():
            return False
        if time.monotonic() >= self._valid_until:
            self.stop(f"redis unreachable: {self._error}" if self._error else "lease renewal late")
            return False
        return True

    def stop(self, reason: str) -> None:
        """holds() is False from now on, saying `reason` (the first reason given stays)."""
        with self._lock:
            if self._stopped.is_set():
                return
            self.reason, self.stopped_at = reason, time.time()
            self._stopped.set()

    def wait_stopped(self, timeout_s: float) -> bool:
        """Block until holds() would be False for a pushed or renewal reason, or `timeout_s`; True if it is."""
        return self._stopped.wait(timeout_s)

    # -- the thread ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the renewal thread (once; later calls do nothing)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=f"tailspec-lease-{self.node}:{self.gpu}",
                                            daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, join_s: float = 0.0) -> None:
        """Stop renewing: the thread renews no more and ends at its next wake (a push, or when its next renewal
        would have been due); wait `join_s` for it."""
        self._closed.set()
        if join_s > 0 and self._thread is not None:
            self._thread.join(join_s)

    def renew(self) -> int | None:
        """One fenced renewal round trip: the code, or None on a Redis error (the lease clock keeps running)."""
        sent = time.monotonic()
        try:
            code = int(self.leases.renew(self.node, self.gpu, self.token, self.ttl_s,
                                         require_heartbeat=self.require_heartbeat))
        except Exception as e:  # noqa: BLE001 - Redis down, a timeout: the last renewal still covers the session
            self._error = type(e).__name__
            return None
        finally:
            self.renewals += 1
            self.renew_wall_s += time.monotonic() - sent
        if code == L.RENEWED:
            self._error = None
            self._valid_until = max(self._valid_until, sent + STOP_AT * self.ttl_s)
        else:
            self.stop(L.REASONS.get(code, f"renew code {code}"))
        return code

    def _run(self) -> None:
        cpu0 = time.thread_time()
        every = self.renew_every_s or self.ttl_s / 4
        sub: Any = None
        next_renew = 0.0
        try:
            while not self._closed.is_set() and self.holds():
                if sub is None:
                    sub = self._subscribe()
                now = time.monotonic()
                if now >= next_renew:
                    ok = self.renew() is not None
                    next_renew = now + (every if ok else min(every, RETRY_S))
                else:  # asleep until a push or the next renewal: no wake-ups in between
                    sub = self._listen(sub, next_renew - now)
                self.cpu_s = time.thread_time() - cpu0
        finally:
            self.cpu_s = time.thread_time() - cpu0
            _close(sub)

    def _subscribe(self) -> Any:
        """A subscription to this GPU's revocations, confirmed by Redis; None when Redis cannot be reached."""
        sub = None
        try:
            sub = self.r.pubsub()
            sub.subscribe(self.channel)
            deadline = time.monotonic() + max(RETRY_S, self.ttl_s / 8)
            while time.monotonic() < deadline:  # the confirmation: a revoke published after it reaches us
                msg = sub.get_message(timeout=RETRY_S)
                if msg is not None and msg.get("type") == "subscribe":
                    return sub
        except Exception as e:  # noqa: BLE001 - renewals alone still keep and end the lease
            self._error = type(e).__name__
        _close(sub)
        return None

    def _listen(self, sub: Any, wait_s: float) -> Any:
        """Wait up to `wait_s` for a pushed revocation; the subscription to go on with (None once it failed)."""
        if sub is None:
            self._closed.wait(max(0.0, min(wait_s, RETRY_S)))
            return None
        try:
            msg = sub.get_message(timeout=max(0.0, wait_s))
        except Exception as e:  # noqa: BLE001 - resubscribed at the next turn
            self._error = type(e).__name__
            _close(sub)
            return None
        if msg is not None and msg.get("type") == "message" and _token(msg.get("data")) == self.token:
            self.pushed = True
            self.stop(L.REASONS[L.REVOKED])
        return sub


def _token(data: Any) -> int | None:
    try:
        return int(data)
    except (TypeError, ValueError):
        return None


def _close(sub: Any) -> None:
    if sub is not None:
        try:
            sub.close()
        except Exception:  # noqa: BLE001, S110 - a dead connection: nothing left to close
            pass
