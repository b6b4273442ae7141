"""What the leading scheduler reads each tick: phase, every worker's progress and every GPU's telemetry.

One round trip: phase, the sizes of the worker and GPU sets and one MGET of every progress and telemetry key (one
command, not a GET each: at a thousand GPUs the client's per-command cost dominates), sent as bytes packed once
while the sets stay the same (packing a thousand keys every tick cost more than reading their values). The sets
themselves are read when a size changed and every MEMBERS_REFRESH_S; when one changed, the keys are built again
and the MGET of the new keys follows. The MGET's answer is compared with the last one position by position (in C:
map and compress), so only payloads whose bytes changed are decoded; an unchanged payload yields the same object
as at the last tick, which the idle detector relies on to step only machines whose inputs changed. A malformed
payload is skipped and reported, at every tick while it stays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress, count
from operator import ne
from typing import Any

from tailspec.core import state
from tailspec.core.state import GpuTelemetry, PhaseInfo, Progress, StateError

# The worker and GPU sets are read whole when their sizes change, and at least this often: tailspec only adds
# members, so a size change is every change it makes; the periodic read catches a set replaced by another of the
# same size from outside.
MEMBERS_REFRESH_S = 1.0


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


@dataclass
class Sent:
    """Round trips and commands sent as packed bytes, which the client's own command hooks do not see."""

    trips: int = 0
    commands: int = 0


class Observer:
    """One leader term's reader of the cluster state (its caches start empty with the term)."""

    def __init__(self, r: Any, cluster: str, bad: Callable[[str, Exception], None], sent: Sent | None = None):
        self.r, self.c, self._bad = r, cluster, bad
        self.sent = sent or Sent()
        self._packed: list[bytes] | None = None  # GET phase, SCARD workers and gpus, MGET of self._keys
        self._members_due = float("-inf")
        self._gpu_members: set | None = None
        self._gpu_keys: list[tuple[str, int]] = []
        self._worker_members: set | None = None
        self._workers: list[str] = []
        # The MGET, position by position: its keys, the names they decode to, the last payloads and their objects.
        self._keys: list[str] = []
        self._names: list[Any] = []
        self._raw: list[Any] = []
        self._objs: list[Any] = []
        self._bad_at: set[int] = set()  # positions whose payload did not decode
        self._dupes = False  # two GPU set members name one (node, gpu): the last one's telemetry counts
        self._progress: dict[str, Progress] = {}
        self._telemetry: dict[tuple[str, int], GpuTelemetry] = {}
        self._phase_raw: Any = None
        self._phase_obj: PhaseInfo | None = None

    def snapshot(self) -> tuple[PhaseInfo | None, dict[str, Progress], dict[tuple[str, int], GpuTelemetry]]:
        """Phase, progress by worker (sorted by name) and telemetry by (node, gpu); the dicts are the caller's."""
        raw_phase, cards, raw = self._read()
        now = time.monotonic()
        known = (len(self._worker_members or ()), len(self._gpu_members or ()))
        if cards != known or now >= self._members_due:
            self._members_due = now + MEMBERS_REFRESH_S
            pipe = self.r.pipeline(transaction=False)
            pipe.smembers(state.key(self.c, "workers"))
            pipe.smembers(state.key(self.c, "gpus"))
            if self._align(*pipe.execute()):  # the sets changed: the keys read were the last ones
                raw = self.r.mget(self._keys) if self._keys else []
        changed = list(compress(count(), map(ne, raw, self._raw)))  # the positions whose bytes changed
        for i in self._bad_at.difference(changed):
            self._decode(i, raw[i])  # still malformed: reported again, as at every tick
        reshaped = self._dupes and bool(changed)
        for i in changed:
            reshaped |= self._update(i, raw[i])
        self._raw = raw
        if reshaped:
            self._rebuild()
        return self._phase(raw_phase), dict(self._progress), dict(self._telemetry)

    def _read(self) -> tuple[Any, tuple[int, int], list]:
        """The phase, the sizes of the worker and GPU sets, and the values of the keys the last sets named, in one
        round trip."""
        c = self.c
        cmds = [("GET", state.key(c, "phase")), ("SCARD", state.key(c, "workers")), ("SCARD", state.key(c, "gpus"))]
        if self._keys:
            cmds.append(("MGET", *self._keys))
        if not hasattr(self.r, "connection_pool") or getattr(self.r, "connection", None) is not None:
            pipe = self.r.pipeline(transaction=False)  # a single-connection client (its lock is its own)
            for cmd in cmds:
                pipe.execute_command(*cmd)
            out = pipe.execute()
        else:
            if self._packed is None:
                conn = self.r.connection_pool.get_connection()
                try:
                    self._packed = conn.pack_commands(cmds)
                finally:
                    self.r.connection_pool.release(conn)
            out = _send_packed(self.r, self._packed, [cmd[0] for cmd in cmds])
            self.sent.trips += 1
            self.sent.commands += len(cmds)
        return out[0], (int(out[1]), int(out[2])), out[3] if self._keys else []

    def _align(self, workers: set, gpus: set) -> bool:
        """Progress keys of the sorted workers, then telemetry keys of the GPUs, built again only when a set
        changed (returns True then); what was read of a key that stays is kept (not decoded again)."""
        if workers == self._worker_members and gpus == self._gpu_members:
            return False
        self._packed = None
        self._worker_members = workers
        self._workers = sorted(_s(w) for w in workers)
        gpu_keys = self._gpus(gpus)
        c = self.c
        keys = [state.key(c, "progress", worker=w) for w in self._workers]
        keys += [state.key(c, "telemetry", node=node, gpu=g) for node, g in gpu_keys]
        old = {k: (v, o, i in self._bad_at) for i, (k, v, o) in enumerate(zip(self._keys, self._raw, self._objs))}
        kept = [old.get(k, (None, None, False)) for k in keys]
        self._keys, self._names = keys, [*self._workers, *gpu_keys]
        self._raw = [v for v, _, _ in kept]
        self._objs = [o for _, o, _ in kept]
        self._bad_at = {i for i, (_, _, bad) in enumerate(kept) if bad}
        self._dupes = len(set(self._names)) != len(self._names)
        self._rebuild()
        return True

    def _update(self, i: int, v: Any) -> bool:
        """Position i's payload changed to v; True when a name appeared or vanished (the dicts' order changes)."""
        had = self._objs[i] is not None
        self._bad_at.discard(i)
        self._objs[i] = None if v is None else self._decode(i, v)
        now = self._objs[i] is not None
        if had and now:
            self._dict_of(i)[self._names[i]] = self._objs[i]
        return had != now

    def _decode(self, i: int, v: bytes) -> Any:
        progress = i < len(self._workers)
        name = self._names[i]
        where = f"progress:{name}" if progress else f"gpu:{name[0]}:{name[1]}"
        try:
            return state.decode(Progress if progress else GpuTelemetry, v, where=where)
        except StateError as e:
            self._bad(where, e)
            self._bad_at.add(i)
            return None

    def _dict_of(self, i: int) -> dict:
        return self._progress if i < len(self._workers) else self._telemetry

    def _rebuild(self) -> None:
        """The dicts in key order (workers sorted, then GPUs as the set listed them), as every tick built them."""
        n = len(self._workers)
        names, objs = self._names, self._objs
        self._progress = {names[i]: objs[i] for i in range(n) if objs[i] is not None}
        self._telemetry = {names[i]: objs[i] for i in range(n, len(names)) if objs[i] is not None}

    def _gpus(self, members: set) -> list[tuple[str, int]]:
        """(node, gpu) of the GPU set's members, parsed again only when the set changed."""
        if members != self._gpu_members:
            self._gpu_members = members
            self._gpu_keys = []
            for g in members:
                node, _, idx = _s(g).rpartition(":")
                if node and idx.isdigit():
                    self._gpu_keys.append((node, int(idx)))
        return self._gpu_keys

    def _phase(self, raw: Any) -> PhaseInfo | None:
        if raw is None:
            return None
        if raw == self._phase_raw:
            return self._phase_obj
        try:
            obj = state.decode(PhaseInfo, raw, where="phase")
        except StateError as e:
            self._bad("phase", e)
            return None
        self._phase_raw, self._phase_obj = raw, obj
        return obj


def _send_packed(r: Any, packed: list[bytes], names: list[str]) -> list[Any]:
    """Commands packed once, sent on a connection of `r`'s pool, their answers parsed as `r` parses them; retried
    on a connection error as the client retries its own commands. A connection whose answers were not all read
    is closed."""
    pool = r.connection_pool
    conn = pool.get_connection()

    def call() -> list[Any]:
        try:
            conn.send_packed_command(packed)
            return [r.parse_response(conn, name) for name in names]
        except BaseException:
            conn.disconnect()
            raise

    try:
        return conn.retry.call_with_retry(call, lambda _: conn.disconnect())
    finally:
        pool.release(conn)
