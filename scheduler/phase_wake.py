"""The scheduler's wait between ticks, cut short by a phase change or a drain: `PhaseWake`.

The RL framework's client PUBLISHes each phase change on a channel named as the phase key
(scheduler/client_writer.py), in the same pipeline that writes the key, so a tick that a message wakes reads the new
phase; and on the same channel, after the progress that says it, each worker's drain. A listener thread holds the
subscription and sets a flag; the scheduler waits for its next tick on that flag. When the trainer enters its update
the revocations then go out within a round trip or two instead of up to a tick later, and the trainer's reclaim wait
(`TailspecClient.wait_reclaimed`) loses that share of a tick; a drained GPU is looked at at once. A simulated GPU's
telemetry monitor waits on its own PhaseWake the same way (scheduler/monitor.py).

The listener, not the loop, meets a Redis outage: it resubscribes every RESUBSCRIBE_S while the loop's waits are
plain sleeps, so the tick grid alone paces the scheduler, as it does for everything else it reads.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tailspec.scheduler")

RESUBSCRIBE_S = 1.0  # after a failed or broken subscription, the listener tries again this much later
LISTEN_S = 0.5  # the listener's longest block on the subscription: how soon it sees close()


@dataclass
class PhaseWake:
    """Wait up to a tick's delay, returning early (True) on a published phase change (`start` the listener)."""

    r: Any  # the scheduler's Redis client; the subscription takes its own connection from the pool
    channel: str  # the phase key's name
    stop: threading.Event = field(default_factory=threading.Event)
    wakes: int = 0  # waits a phase change cut short

    def __post_init__(self) -> None:
        self._flag = threading.Event()
        self._closed = threading.Event()
        self.subscribed = threading.Event()  # set while a confirmed subscription is held
        self._thread: threading.Thread | None = None

    def start(self) -> PhaseWake:
        self._thread = threading.Thread(target=self._listen, name="tailspec-phase-wake", daemon=True)
        self._thread.start()
        return self

    def wait(self, delay_s: float) -> bool:
        """Sleep `delay_s` (at most a tick), or until a phase change is published or `stop` is set; True when a
        phase change woke us."""
        if self.stop.is_set():
            return False
        if not self._flag.wait(max(0.0, delay_s)):
            return False
        self._flag.clear()  # a message between the wake and here only asks for the tick about to run
        if self.stop.is_set():
            return False
        self.wakes += 1
        return True

    def close(self) -> None:
        self._closed.set()
        self._flag.set()  # a loop still waiting goes on to see its stop
        if self._thread is not None:
            self._thread.join(LISTEN_S + 1.0)

    def _listen(self) -> None:
        while not self._closed.is_set():
            sub = None
            try:
                sub = self.r.pubsub()
                sub.subscribe(self.channel)
                while not self._closed.is_set():
                    msg = sub.get_message(timeout=LISTEN_S)
                    if msg is None:
                        continue
                    if msg.get("type") == "subscribe":
                        self.subscribed.set()
                    elif msg.get("type") == "message":
                        self._flag.set()
            except Exception as e:  # noqa: BLE001 - Redis down: the loop sleeps out its ticks meanwhile
                log.debug("phase subscription: %s", e)
            finally:
                self.subscribed.clear()
                _close(sub)
            self._closed.wait(RESUBSCRIBE_S)


def _close(sub: Any) -> None:
    if sub is not None:
        try:
            sub.close()
        except Exception:  # noqa: BLE001, S110 - closing a broken connection
            pass
