"""What still holds a lent GPU, as the trainer's `TailspecClient.wait_reclaimed` polls it: `HeldReader`.

A GPU is held while a session that has not ended or released it exists, or while the scheduler's status of the GPU
says lent or reclaiming by anything but such an ended session. The cluster's `sessions` set names every session
ever started, and a run lends the same GPUs again at every step, so reading every record at every poll costs the
trainer's thread in proportion to the run's age. An ended session (stopped, failed, or its GPU released) never
holds a GPU again: a later lend is another session. So the reader remembers the sessions it saw end and reads only
the others' records; the sets are read whole only when their sizes change (tailspec only adds members, so a size
change is every change it makes). A poll is then one round trip: the two set sizes and one MGET of the live
sessions' records and the GPUs' statuses; a second one follows only when a set grew.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tailspec.core import state
from tailspec.core.state import GpuState, GpuStatus, SessionInfo

log = logging.getLogger("tailspec.scheduler.client")


class HeldReader:
    """One client's cached view of the cluster's sessions and GPUs for `held` (thread-safe)."""

    def __init__(self, r: Any, cluster: str):
        self.r, self.c = r, cluster
        self._lock = threading.Lock()
        self._cards: tuple[int, int] | None = None  # sizes of the session and GPU sets when last read whole
        self._ended: set[str] = set()  # sessions seen stopped, failed or released: never read again
        self._live: list[str] = []  # every other session of the set, sorted
        self._gpus: list[tuple[str, int]] = []  # the GPU set's members, sorted
        self.records_read = 0  # session records fetched, over the reader's life (what the cache saves shows here)

    def held(self) -> list[str]:
        """What still holds a lent GPU ("node0:gpu1 held by session … (running, step 12)"); [] when nothing does."""
        with self._lock:
            cards, records, statuses = self._read()
            if cards != self._cards:
                self._members(cards)
                _, records, statuses = self._read()
            return self._judge(records, statuses)

    def _read(self) -> tuple[tuple[int, int], list, list]:
        """One round trip: the set sizes, then the live sessions' records and the GPUs' statuses as last known."""
        c = self.c
        p = self.r.pipeline(transaction=False)
        p.scard(state.key(c, "sessions"))
        p.scard(state.key(c, "gpus"))
        if self._live:
            p.mget([state.key(c, "session", session_id=sid) for sid in self._live])
        if self._gpus:
            p.mget([state.key(c, "gpu_status", node=node, gpu=gpu) for node, gpu in self._gpus])
        got = p.execute()
        self.records_read += len(self._live)
        records = got[2] if self._live else []
        statuses = got[-1] if self._gpus else []
        return (int(got[0]), int(got[1])), records, statuses

    def _members(self, cards: tuple[int, int]) -> None:
        p = self.r.pipeline(transaction=False)
        p.smembers(state.key(self.c, "sessions"))
        p.smembers(state.key(self.c, "gpus"))
        sids, gpus = p.execute()
        if self._cards is not None and cards[0] < self._cards[0]:  # the set was cleared: its ids may come again
            self._ended.clear()
        self._live = sorted(s for s in (state.text(x) for x in sids) if s not in self._ended)
        self._gpus = [k for k in map(state.gpu_of, sorted(state.text(x) for x in gpus)) if k is not None]
        self._cards = cards

    def _judge(self, records: list, statuses: list) -> list[str]:
        held: list[str] = []
        live: list[str] = []
        for sid, raw in zip(self._live, records):
            key = state.key(self.c, "session", session_id=sid)
            try:
                info = None if raw is None else state.decode(SessionInfo, raw, where=key)
            except state.StateError as e:  # one bad record must not make the trainer wait for nothing
                log.warning("tailspec: skipping %s", e)
                live.append(sid)
                continue
            if info is not None and (info.status in ("stopped", "failed") or info.released_at is not None):
                self._ended.add(sid)  # ended, or its GPU freed and only its host-side merge left
                continue
            live.append(sid)
            if info is not None:
                held.append(f"{info.node}:gpu{info.gpu} held by session {info.session_id} ({info.status}, "
                            f"step {info.step})")
        self._live = live
        for (node, gpu), raw in zip(self._gpus, statuses):
            key = state.key(self.c, "gpu_status", node=node, gpu=gpu)
            try:
                st = None if raw is None else state.decode(GpuStatus, raw, where=key)
            except state.StateError as e:
                log.warning("tailspec: skipping %s", e)
                continue
            # A GPU whose session has ended is back, although the scheduler marks it so only at its next tick
            # (up to scheduler.tick_s later): the session's final record is written after its memory is freed.
            if st is not None and st.state in (GpuState.LENT, GpuState.RECLAIMING) \
                    and not (st.session_id and st.session_id in self._ended):
                who = f"session {st.session_id}" if st.session_id else f"lease {st.lease_token}"
                held.append(f"{node}:gpu{gpu} {st.state.value} by {who}")
        return held

