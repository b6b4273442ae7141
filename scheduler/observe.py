"""What the leading scheduler reads each tick: phase, every worker's progress and every GPU's telemetry.

Two round trips: phase and the worker and GPU sets, then one MGET of every progress and telemetry key (one
command, not a GET each: at a thousand GPUs the client's per-command cost dominates). A payload whose bytes
did not change since the last tick is not decoded again. A malformed payload is skipped and reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tailspec.core import state
from tailspec.core.state import GpuTelemetry, PhaseInfo, Progress, StateError


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class Observer:
    """One leader term's reader of the cluster state (its caches start empty with the term)."""

    def __init__(self, r: Any, cluster: str, bad: Callable[[str, Exception], None]):
        self.r, self.c, self._bad = r, cluster, bad
        self._decoded: dict[str, tuple[bytes, Any]] = {}  # key → (payload, decoded): undecoded while unchanged
        self._gpu_members: set | None = None
        self._gpu_keys: list[tuple[str, int]] = []

    def snapshot(self) -> tuple[PhaseInfo | None, dict[str, Progress], dict[tuple[str, int], GpuTelemetry]]:
        c = self.c
        pipe = self.r.pipeline(transaction=False)
        pipe.get(state.key(c, "phase"))
        pipe.smembers(state.key(c, "workers"))
        pipe.smembers(state.key(c, "gpus"))
        raw_phase, workers, gpus = pipe.execute()
        workers = sorted(_s(w) for w in workers)
        gpu_keys = self._gpus(gpus)
        keys = [state.key(c, "progress", worker=w) for w in workers]
        keys += [state.key(c, "telemetry", node=node, gpu=g) for node, g in gpu_keys]
        raw = self.r.mget(keys) if keys else []
        seen: dict[str, Any] = {}
        phase = self._phase(raw_phase)
        progress = self._decode_all(Progress, keys, workers, raw, seen, lambda w: f"progress:{w}")
        n = len(workers)
        telemetry = self._decode_all(GpuTelemetry, keys[n:], gpu_keys, raw[n:], seen,
                                     lambda gk: f"gpu:{gk[0]}:{gk[1]}")
        raws = dict(zip(keys, raw))
        self._decoded = {k: (raws[k], obj) for k, obj in seen.items()}
        return phase, progress, telemetry

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
        try:
            return state.decode(PhaseInfo, raw, where="phase")
        except StateError as e:
            self._bad("phase", e)
            return None

    def _decode_all(self, model: type, keys: list[str], names: list, raw: list, seen: dict[str, Any],
                    where: Callable[[Any], str]) -> dict:
        """name → decoded payload for each present key; the last tick's object where the bytes are unchanged."""
        out: dict = {}
        for k, name, v in zip(keys, names, raw):
            if v is None:
                continue
            hit = self._decoded.get(k)
            if hit is not None and hit[0] == v:
                out[name] = seen[k] = hit[1]
                continue
            try:
                out[name] = state.decode(model, v, where=where(name))
            except StateError as e:
                self._bad(where(name), e)
                continue
            seen[k] = out[name]
        return out
