"""What the leading scheduler reads each tick: phase, every worker's progress, every node's GPU health, and the
telemetry samples of the GPUs whose step reads a sample's values.

A GPU's step reads its sample's values (utilisation, memory, the sample's time) only while its worker reports it
drained (IdleDetector.sampled); every other step looks at whether the GPU's telemetry is there and failing, which
each node's monitor writes as one `gpu_health:{node}` record whose bytes stay the same while nothing fails,
recovers, appears or goes away (scheduler/monitor.py). So a tick reads:

1. `read`, one round trip: phase, the sizes of the worker and GPU sets and one MGET of every progress key and every
   node's health key (one command, not a GET each: at a thousand GPUs the client's per-command cost dominates),
   sent as bytes packed once while the sets stay the same, in one send (one system call). The sets themselves are read when a size changed and
   every MEMBERS_REFRESH_S; when one changed, the keys are built again and the MGET of the new keys follows.
2. `telemetry(sampled)`: the samples of the sampled GPUs that their node's health lists. The first round trip
   carries one MGET of the samples of the GPUs sampled at the last tick (packed once while that set stays the
   same), so only GPUs sampled for the first time cost one more round trip. The leading scheduler sends its leader
   renewal in the first round trip too (`read(lead=...)`): a tick is one round trip when nothing is written.

Both answers are compared with the last ones position by position (in C: map and compress), so only payloads whose
bytes changed are decoded; an unchanged payload yields the same object as at the last tick, and a GPU's health the
same `Health`, which the idle detector relies on to step only machines whose inputs changed. A GPU is there while
its node's health lists it (and, when sampled, while its sample is there); the telemetry mapping lists GPUs in the
GPU set's order. A malformed payload is skipped and reported, at every tick while it stays (a malformed health
record: its node's GPUs have no telemetry).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import compress, count, repeat
from operator import is_, ne
from typing import Any

from tailspec.core import state
from tailspec.core.state import GpuTelemetry, NodeHealth, PhaseInfo, Progress, StateError
from tailspec.scheduler.idle import Health

# The worker and GPU sets are read whole when their sizes change, and at least this often: tailspec only adds
# members, so a size change is every change it makes; the periodic read catches a set replaced by another of the
# same size from outside.
MEMBERS_REFRESH_S = 1.0

GpuKey = tuple[str, int]
_OK = Health()  # the health of every GPU sampled without an error


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
        self._cmds: list[tuple] = []  # GET phase, SCARD workers and gpus, MGET of self._keys
        self._packed: list[bytes] | None = None  # the same, packed
        self._members_due = float("-inf")
        self._gpu_members: set | None = None
        self._gpu_keys: list[GpuKey] = []  # the GPU set's members, parsed, in its order
        self._worker_members: set | None = None
        self._workers: list[str] = []
        # The first MGET, position by position: its keys, the names they decode to (workers, then nodes), the last
        # payloads and their objects.
        self._keys: list[str] = []
        self._names: list[str] = []
        self._raw: list[Any] = []
        self._objs: list[Any] = []
        self._bad_at: set[int] = set()  # positions whose payload did not decode
        self._progress: dict[str, Progress] = {}
        self._health: dict[GpuKey, Health] = {}  # every GPU its node's health lists, in the GPU set's order
        self._health_stale = False
        # The samples: the GPUs sampled at the last tick that their node's health lists, the MGET of their samples
        # (sent with `read`'s commands), their last payloads and objects.
        self._want: set[GpuKey] = set()
        self._want_keys: list[GpuKey] = []
        self._want_cmds: list[tuple] = []
        self._want_packed: list[bytes] | None = None
        self._spec: tuple[list[GpuKey], list[Any]] | None = None  # those keys and their samples, as `read` read them
        self._want_raw: list[Any] = []
        self._want_objs: list[GpuTelemetry | None] = []
        self._want_bad: set[int] = set()  # positions whose sample did not decode
        self._phase_raw: Any = None
        self._phase_obj: PhaseInfo | None = None

    def read(self, lead: tuple | None = None) -> tuple[PhaseInfo | None, dict[str, Progress], Any]:
        """Phase, progress by worker (sorted by name; the dict is the caller's) and the answer to `lead`, a command
        sent first in the same round trip (None: none). The nodes' health, and the samples of the GPUs sampled at
        the last tick (read in the same round trip), are kept for `telemetry`."""
        lead_answer, raw_phase, cards, raw = self._read(lead)
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
        n = len(self._workers)
        for i in changed:
            self._update(i, raw[i])
            self._health_stale |= i >= n
        self._raw = raw
        if self._health_stale:
            self._rebuild_health()
        return self._phase(raw_phase), dict(self._progress), lead_answer

    def telemetry(self, sampled: Iterable[GpuKey]) -> dict[GpuKey, GpuTelemetry | Health]:
        """Telemetry by (node, gpu) of every GPU its node's health lists: the sample of each one in `sampled` (absent
        when its sample is missing or malformed), its `Health` for the others. The samples `read` fetched serve
        the GPUs sampled at the last tick too; only the others cost a round trip."""
        tel: dict[GpuKey, Any] = dict(self._health)
        want = self._health.keys() & sampled
        spec, self._spec = self._spec, None
        if spec is not None and spec[0] is self._want_keys and want == self._want:
            raw = spec[1]
        else:
            got = dict(zip(*spec)) if spec is not None else {}
            if want != self._want:
                self._want_again(want)
            new = [k for k in self._want_keys if k not in got]
            if new:
                got.update(zip(new, self._roundtrip([], [], ("MGET", *self._sample_keys(new)))[0]))
            raw = [got[k] for k in self._want_keys]
        if not want:
            return tel
        objs, bad = self._want_objs, self._want_bad
        changed = list(compress(count(), map(ne, raw, self._want_raw)))
        for i in bad.difference(changed):
            self._decode_sample(i, raw[i])  # still malformed: reported again, as at every tick
        for i in changed:
            bad.discard(i)
            objs[i] = None if raw[i] is None else self._decode_sample(i, raw[i])
        self._want_raw = raw
        tel.update(zip(self._want_keys, objs))
        for k in compress(self._want_keys, map(is_, objs, repeat(None))):  # (`None in objs` calls each __eq__)
            del tel[k]  # its sample is missing or malformed: no telemetry
        return tel

    def _want_again(self, want: set[GpuKey]) -> None:
        """The sampled GPUs are `want` now; what was read of a GPU that stays is kept (not decoded again)."""
        old = dict(zip(self._want_keys, zip(self._want_raw, self._want_objs)))
        self._want = want
        self._want_keys = list(want)
        kept = [old.get(k, (None, None)) for k in self._want_keys]
        self._want_raw = [v for v, _ in kept]
        self._want_objs = [o for _, o in kept]
        self._want_bad = {i for i, (v, o) in enumerate(kept) if v is not None and o is None}
        self._want_cmds = [("MGET", *self._sample_keys(self._want_keys))] if want else []
        self._want_packed = None

    def _sample_keys(self, gpus: list[GpuKey]) -> list[str]:
        return [state.key(self.c, "telemetry", node=n, gpu=g) for n, g in gpus]

    def _read(self, lead: tuple | None) -> tuple[Any, Any, tuple[int, int], list]:
        """In one round trip: `lead`'s answer, the phase, the sizes of the worker and GPU sets, the values of the keys
        the last sets named, and the samples of the GPUs sampled at the last tick (kept for `telemetry`)."""
        if not self._cmds:
            c = self.c
            self._cmds = [("GET", state.key(c, "phase")), ("SCARD", state.key(c, "workers")),
                          ("SCARD", state.key(c, "gpus"))]
            if self._keys:
                self._cmds.append(("MGET", *self._keys))
        cmds, want = self._cmds, self._want_cmds
        packed = None
        if self._pooled():
            if self._packed is None:
                self._packed = self._pack(cmds)
            if self._want_packed is None and want:
                self._want_packed = self._pack(want)
            packed = self._packed + (self._want_packed if want else [])
        out = self._roundtrip([*cmds, *want], packed, lead)
        if lead is None:
            out.insert(0, None)
        self._spec = (self._want_keys, out[-1] if want else [])
        return out[0], out[1], (int(out[2]), int(out[3])), out[4] if self._keys else []

    def _pooled(self) -> bool:
        """A client with a connection pool (commands may be sent packed); else a single-connection client."""
        return hasattr(self.r, "connection_pool") and getattr(self.r, "connection", None) is None

    def _pack(self, cmds: list[tuple]) -> list[bytes]:
        conn = self.r.connection_pool.get_connection()
        try:
            return conn.pack_commands(cmds)
        finally:
            self.r.connection_pool.release(conn)

    def _roundtrip(self, cmds: list[tuple], packed: list[bytes] | None = None, lead: tuple | None = None
                   ) -> list[Any]:
        """`lead` (if any) and `cmds` in one round trip, their answers in order; `packed`: `cmds` packed already."""
        if not self._pooled():
            pipe = self.r.pipeline(transaction=False)  # a single-connection client (its lock is its own)
            for cmd in [lead, *cmds] if lead is not None else cmds:
                pipe.execute_command(*cmd)
            return pipe.execute()
        out = _send_packed(self.r, self._pack(cmds) if packed is None else packed, [cmd[0] for cmd in cmds], lead)
        self.sent.trips += 1
        self.sent.commands += len(cmds) + (lead is not None)
        return out

    def _align(self, workers: set, gpus: set) -> bool:
        """Progress keys of the sorted workers, then health keys of the GPUs' nodes (sorted), built again only when a
        set changed (returns True then); what was read of a key that stays is kept (not decoded again)."""
        if workers == self._worker_members and gpus == self._gpu_members:
            return False
        self._cmds, self._packed = [], None
        self._worker_members = workers
        self._workers = sorted(state.text(w) for w in workers)
        self._gpus(gpus)
        nodes = sorted({node for node, _ in self._gpu_keys})
        c = self.c
        keys = [state.key(c, "progress", worker=w) for w in self._workers]
        keys += [state.key(c, "gpu_health", node=node) for node in nodes]
        old = {k: (v, o, i in self._bad_at) for i, (k, v, o) in enumerate(zip(self._keys, self._raw, self._objs))}
        kept = [old.get(k, (None, None, False)) for k in keys]
        self._keys, self._names = keys, [*self._workers, *nodes]
        self._raw = [v for v, _, _ in kept]
        self._objs = [o for _, o, _ in kept]
        self._bad_at = {i for i, (_, _, bad) in enumerate(kept) if bad}
        n = len(self._workers)
        self._progress = {self._names[i]: o for i, o in enumerate(self._objs[:n]) if o is not None}
        self._health_stale = True
        return True

    def _update(self, i: int, v: Any) -> None:
        """Position i's payload changed to v."""
        self._bad_at.discard(i)
        obj = self._objs[i] = None if v is None else self._decode(i, v)
        if i < len(self._workers):
            name = self._names[i]
            if obj is None:
                self._progress.pop(name, None)
            elif name in self._progress:
                self._progress[name] = obj
            else:  # a worker reported again: the dict stays in sorted order
                self._progress = {w: o for w, o in zip(self._workers, self._objs) if o is not None}

    def _decode(self, i: int, v: bytes) -> Any:
        progress = i < len(self._workers)
        name = self._names[i]
        where = f"progress:{name}" if progress else f"gpu_health:{name}"
        try:
            return state.decode(Progress if progress else NodeHealth, v, where=where)
        except StateError as e:
            self._bad(where, e)
            self._bad_at.add(i)
            return None

    def _decode_sample(self, i: int, v: bytes) -> GpuTelemetry | None:
        node, gpu = self._want_keys[i]
        where = f"gpu:{node}:{gpu}"
        self._want_bad.discard(i)
        try:
            return state.decode(GpuTelemetry, v, where=where)
        except StateError as e:
            self._bad(where, e)
            self._want_bad.add(i)
            return None

    def _rebuild_health(self) -> None:
        """Every GPU's Health from its node's record, in the GPU set's order; a GPU's Health object stays the same
        while its error does."""
        self._health_stale = False
        n = len(self._workers)
        nodes = {self._names[i]: o for i, o in enumerate(self._objs[n:], n) if o is not None}
        listed = {node: set(h.gpus) for node, h in nodes.items()}
        old, health = self._health, {}
        for k in self._gpu_keys:
            node, g = k
            if g not in listed.get(node, ()):
                continue
            err = nodes[node].errors.get(g)
            prev = old.get(k)
            health[k] = _OK if err is None else prev if prev is not None and prev.error == err else Health(err)
        self._health = health

    def _gpus(self, members: set) -> None:
        """(node, gpu) of the GPU set's members, parsed again only when the set changed."""
        if members != self._gpu_members:
            self._gpu_members = members
            self._gpu_keys = [k for k in map(state.gpu_of, members) if k is not None]

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


def _send_packed(r: Any, packed: list[bytes], names: list[str], lead: tuple | None = None) -> list[Any]:
    """Commands packed once, after `lead` (packed here, if any), sent on a connection of `r`'s pool, their answers
    parsed as `r` parses them; retried on a connection error as the client retries its own commands. A connection
    whose answers were not all read is closed."""
    pool = r.connection_pool
    conn = pool.get_connection()
    if lead is not None:
        packed = [*conn.pack_command(*lead), *packed]
        names = [lead[0], *names]
    packed = [b"".join(packed)]  # one send, not one per chunk: each is a system call and a wake-up of the server

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
