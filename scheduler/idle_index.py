"""Which GPUs' state machines one detector tick steps (scheduler/idle.py), and the machines by state.

Stepping a machine again on the inputs of its last step decides nothing new, except where the decision depends
on time, so a tick steps only the machines whose step could differ:
- new machines, and machines changed from outside the tick (lent, backed off);
- a machine whose worker's progress or whose telemetry is another object than at the last tick, or appeared or
  vanished (inputs are snapshots, never changed in place: the observer hands the same object again while a
  payload's bytes are unchanged); for GENERATING and LENT machines, only telemetry that became usable or
  unusable (see below);
- every machine, when the phase changed (drained and revoked depend on it);
- a LENT or RECLAIMING machine whose session is among the stopped ones;
- every DRAINED machine (the idle window, the expected tail and the memory needed move with time and with other
  workers' progress);
- a RECLAIMING machine whose stop deadline is due (a timer heap instead of a look at every machine).
UNKNOWN, GENERATING and LENT machines decide on their own inputs, the phase and the stopped sessions alone; a
GENERATING or LENT one looks at its telemetry only for whether it is there without an error, so a new sample that
leaves that as it was does not step it either.

With 1,024 GPUs most ticks step only the few drained machines and those whose worker reported.

It also keeps the GPUs that workers reporting no active request in a rollout name (`sampled`: the GPUs whose step
may read a telemetry sample's values), updated only for workers whose report changed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from itertools import compress
from operator import is_not
from typing import Any

from tailspec.core.state import GpuState

GpuKey = tuple[str, int]

# A deadline is looked at this much before it is due: the machine's own step compares the exact times, so early
# is one extra step and never a missed or late reclaim.
TIMER_EARLY_S = 1e-3

_MISSING = object()  # never a phase: the first tick steps everything


class StepIndex:
    """One detector's bookkeeping: the inputs of the last tick, machines by state, the RECLAIMING deadlines, the
    lent sessions, and the machines changed since the caller last asked (`take_changed`)."""

    def __init__(self) -> None:
        self.order: dict[GpuKey, int] = {}  # key → creation number: machines are stepped in creation order
        # Each machine's key object, which the state sets and the drained set hold: a set operation between sets of
        # the same objects matches by identity, between equal tuples it compares them (0.1 ms per thousand).
        self._canon: dict[GpuKey, GpuKey] = {}
        self.by_state: dict[GpuState, set[GpuKey]] = {s: set() for s in GpuState}
        self.sessions: dict[str, GpuKey] = {}  # session id → the GPU it is lent on (LENT, RECLAIMING)
        self._phase: Any = _MISSING
        self._owner: dict[GpuKey, Any] = {}  # the owners and telemetry the last tick stepped on
        self._progress: dict[str, Any] = {}
        self._owner_map: dict[GpuKey, Any] = {}
        self._drain: dict[str, tuple[GpuKey, ...]] = {}  # worker → its GPUs while it reports no active request
        self._drain_count: dict[GpuKey, int] = {}  # GPU → how many of those name it
        self._drained: set[GpuKey] = set()  # the union of those
        self._telemetry: dict[GpuKey, Any] = {}
        self._timers: list[tuple[float, int, GpuKey]] = []
        self._timer_due: dict[GpuKey, float] = {}
        self._pending: set[GpuKey] = set()  # stepped at the next tick whatever its inputs
        self._changed: set[GpuKey] = set()

    def added(self, key: GpuKey) -> None:
        self.order[key] = len(self.order)
        self._canon[key] = key
        self.by_state[GpuState.UNKNOWN].add(key)
        self.touched(key)

    def touched(self, key: GpuKey) -> None:
        """Changed from outside a tick: stepped at the next one, its status published."""
        self._pending.add(key)
        self._changed.add(key)

    def moved(self, key: GpuKey, old: GpuState, new: GpuState) -> None:
        if old != new:
            self.by_state[old].discard(key)
            self.by_state[new].add(self._canon.get(key, key))

    def unseen(self, telemetry: Mapping[GpuKey, Any], owner: Mapping[GpuKey, Any],
               machines: Mapping[GpuKey, Any]) -> list[GpuKey]:
        """Keys of `telemetry` or `owner` with no machine yet (before `due`: the last tick's inputs all have one)."""
        out: list[GpuKey] = []
        for keys, last in ((telemetry, self._telemetry), (owner, self._owner)):
            if not same_keys(keys, last) and not keys.keys() <= machines.keys():  # checked in C: rare
                out += [k for k in keys if k not in machines]
        return out

    def count(self, *states: GpuState) -> int:
        return sum(len(self.by_state[s]) for s in states)

    def owners(self, progress: Mapping[str, Any]) -> dict[GpuKey, Any]:
        """(node, gpu) → the progress of the worker owning it (the last one in `progress` that names it). Built
        again only when a worker appeared, vanished or changed its GPUs; a new report of a worker with the same
        GPUs replaces its entries where it owned them. The dict returned is not changed afterwards."""
        last = self._progress
        changed = list(compress(progress.keys(), map(is_not, progress.values(), map(last.get, progress.keys()))))
        if not changed and last.keys() <= progress.keys():
            return self._owner_map
        rebuild = not last.keys() <= progress.keys() or any(
            w not in last or last[w].node != progress[w].node or last[w].gpus != progress[w].gpus for w in changed)
        if rebuild:
            owner: dict[GpuKey, Any] = {}
            for p in progress.values():
                node = p.node
                for g in p.gpus:
                    owner[(node, g)] = p
        else:
            owner = dict(self._owner_map)
            for w in changed:
                old, p = last[w], progress[w]
                for g in p.gpus:
                    if owner.get((p.node, g)) is old:
                        owner[(p.node, g)] = p
        self._progress, self._owner_map = dict(progress), owner
        self._drains(progress, changed, rebuild)
        return owner

    def _drains(self, progress: Mapping[str, Any], workers: Iterable[str], rebuild: bool) -> None:
        """The drained GPU set after the reports of `workers` changed (every worker's when `rebuild`): counts per GPU
        (two workers may name one), so a worker that drains or resumes costs its own GPUs, not a pass over all."""
        if rebuild:
            self._drain, self._drain_count, self._drained = {}, {}, set()
            workers = progress.keys()
        drain, counts, drained, canon = self._drain, self._drain_count, self._drained, self._canon
        for w in workers:
            p = progress[w]
            keys = tuple(canon.get(k, k) for k in ((p.node, g) for g in p.gpus)) \
                if p.active == 0 and p.phase == "rollout" else ()
            old = drain.get(w, ())
            if old == keys:
                continue
            drain[w] = keys
            for k in old:
                counts[k] -= 1
                if not counts[k]:
                    del counts[k]
                    drained.discard(k)
            for k in keys:
                counts[k] = counts.get(k, 0) + 1
                drained.add(k)

    def sampled(self, stopped: Iterable[str]) -> set[GpuKey]:
        """GPUs named by workers that report no active request in a rollout phase (as of the last `owners`), less
        those LENT whose session is not among `stopped`."""
        drained = self._drained
        keys = drained - self.by_state[GpuState.LENT]
        keys.update(drained.intersection(filter(None, map(self.sessions.get, stopped))))
        return keys

    def due(self, now: float, phase: Any, owner: Mapping[GpuKey, Any], telemetry: Mapping[GpuKey, Any],
            stopped: Iterable[str], everything: bool) -> list[GpuKey]:
        """The keys to step this tick, in creation order; remembers this tick's inputs for the next."""
        phase_changed = phase != self._phase
        self._phase = phase
        dirty = self._pending
        self._pending = set()
        _diff(self._owner, owner, dirty)
        tel: set[GpuKey] = set()
        _diff(self._telemetry, telemetry, tel)
        last_tel = self._telemetry
        self._owner, self._telemetry = dict(owner), dict(telemetry)
        gen, lent = self.by_state[GpuState.GENERATING], self.by_state[GpuState.LENT]
        for k in tel.difference(dirty):
            # A GENERATING or LENT machine looks at its telemetry only for whether it is usable (there, no error):
            # a new sample that leaves that as it was, its worker's report unchanged, decides nothing new.
            if (k in gen or k in lent) and _usable(last_tel.get(k)) == _usable(telemetry.get(k)):
                continue
            dirty.add(k)
        if everything or phase_changed:
            keys = list(self.order)
            self._changed.update(keys)
            return keys
        dirty |= self.by_state[GpuState.DRAINED]
        dirty.update(filter(None, map(self.sessions.get, stopped)))
        timers = self._timers
        while timers and timers[0][0] <= now + TIMER_EARLY_S:
            due, _, k = heapq.heappop(timers)
            if self._timer_due.get(k) == due:
                del self._timer_due[k]
                dirty.add(k)
        self._changed |= dirty
        order = self.order
        return sorted(dirty, key=order.__getitem__)

    def stepped(self, key: GpuKey, old: GpuState, new: GpuState, old_session: str | None,
                session: str | None, deadline: float | None) -> None:
        """After a step: the state sets, the session index and the stop deadline of a RECLAIMING machine."""
        self.moved(key, old, new)
        if old_session is not None and session != old_session:
            self.sessions.pop(old_session, None)
        if new == GpuState.RECLAIMING and deadline is not None and self._timer_due.get(key) != deadline:
            self._timer_due[key] = deadline
            heapq.heappush(self._timers, (deadline, self.order[key], key))

    def lent(self, key: GpuKey, session: str) -> None:
        self.sessions[session] = self._canon.get(key, key)
        self.touched(key)

    def take_changed(self) -> list[GpuKey]:
        """Machines stepped or changed since the last call, in creation order (their status may have changed)."""
        changed, self._changed = self._changed, set()
        order = self.order
        return sorted(changed, key=order.__getitem__)


def _usable(t: Any) -> bool:
    return t is not None and t.error is None


def same_keys(a: Mapping[GpuKey, Any], b: Mapping[GpuKey, Any]) -> bool:
    """Whether `a` and `b` hold equal keys in the same order. Cheap when they are the very same key objects (list
    equality looks at identity first), where a lookup by key hashes the (node, gpu) tuple again (tuples do not keep
    their hash: 0.1 ms per thousand keys); the observer's and the index's dicts keep their key objects from tick to
    tick."""
    return len(a) == len(b) and list(a) == list(b)  # list equality looks at identity first, then equality


def _diff(last: Mapping[GpuKey, Any], now: Mapping[GpuKey, Any], dirty: set[GpuKey]) -> None:
    """Adds to `dirty` every key whose value is another object than in `last`, or that appeared or vanished.
    In C (map, compress): at a thousand GPUs a Python loop over every key each tick is most of a tick's cost; with
    the same keys as `last` (same_keys), position by position without hashing a key."""
    if same_keys(last, now):
        dirty.update(compress(now.keys(), map(is_not, now.values(), last.values())))
        return
    dirty.update(compress(now.keys(), map(is_not, now.values(), map(last.get, now.keys()))))
    if not last.keys() <= now.keys():
        dirty.update(last.keys() - now.keys())
