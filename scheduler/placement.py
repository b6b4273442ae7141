"""Which CPU cores a simulated GPU owns.

On a machine without GPUs each simulated GPU stands for a whole device: its own compute, shared by its
rollout worker and whatever session is lent on it, and by nothing else. So the host's cores are split into
equal contiguous shares, one per simulated GPU, and every process that works "on" a GPU pins itself to its
share (`sched_setaffinity`, and torch's thread count to match). Without the split, a session lent on a
drained GPU trains on the cores the other GPUs' long tail is decoding on, and the miniature measures the
opposite of what the cluster does.

More simulated GPUs than cores need a CPU quota: where the machine lets this process create one
(scheduler/cpu_quota.py: a writable cgroup cpu controller), up to `MAX_GPUS_PER_CORE` GPUs share a core, each
held to an equal fraction of what is left of it after `HOST_SHARE` (`shares`). The host's share is for
what runs beside the GPUs on a real node's own CPUs (the RL driver, the scheduler, Redis): with the GPUs'
quotas adding up to whole cores, every lent GPU training at its quota left that work to be taken from the
tail's workers, so co-training slowed the tail it runs beside, which a GPU node does not. Elsewhere a run
that asks for more GPUs than cores gets fewer (`gpus_that_fit`): an unsplit machine breaks the ratio the
miniature stands for.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass

from tailspec.core.config import TailspecConfig
from tailspec.scheduler import cpu_quota

log = logging.getLogger("tailspec.scheduler")

# Of each core shared under a CPU quota, what no GPU gets: the host side's own work (the RL driver, the scheduler,
# Redis) runs there while lent GPUs train at their quotas.
HOST_SHARE = 0.1
CPUS_ENV = "TAILSPEC_CPUS"  # "0,1": the cores the process pins itself to (session processes)


def host_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask, not the machine's count: a container or a
    `taskset` may have narrowed it)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS): every core
        return list(range(os.cpu_count() or 1))


MAX_GPUS_PER_CORE = 2  # below half a core a simulated GPU's decode steps wait on the quota more than they compute


@dataclass(frozen=True)
class Share:
    """A simulated GPU's compute: its cores, and the fraction of them it may use (1.0: whole cores, no quota)."""

    cpus: list[int]
    fraction: float = 1.0


def gpus_that_fit(requested: int, cpus: list[int] | None = None, quota: bool = False) -> int:
    """How many simulated GPUs get compute of their own: min(requested, cores), or up to MAX_GPUS_PER_CORE per
    core where a CPU quota can hold each to its share (`quota`)."""
    n = len(host_cpus() if cpus is None else cpus)
    return max(1, min(requested, n * (MAX_GPUS_PER_CORE if quota else 1)))


def shares(n_gpus: int, cpus: list[int] | None = None, quota: bool = False) -> list[Share]:
    """Each simulated GPU's compute: whole cores (`split`) when there are enough; else, with `quota`, GPU g gets
    core g // k at (1 - HOST_SHARE)/k of it, k = GPUs per core (equal shares; a core left half used stays the
    host's)."""
    cpus = host_cpus() if cpus is None else list(cpus)
    if n_gpus <= len(cpus):
        return [Share(c) for c in split(n_gpus, cpus)]
    if not quota:
        split(n_gpus, cpus)  # raises, naming how many fit
    if n_gpus > len(cpus) * MAX_GPUS_PER_CORE:
        raise ValueError(f"{n_gpus} simulated GPUs on {len(cpus)} cores ({format_cpus(cpus)}): at most "
                         f"{MAX_GPUS_PER_CORE} share a core under a CPU quota; run at most "
                         f"{len(cpus) * MAX_GPUS_PER_CORE}")
    k = math.ceil(n_gpus / len(cpus))
    return [Share([cpus[g // k]], round((1.0 - HOST_SHARE) / k, 6)) for g in range(n_gpus)]


def split(n_gpus: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Core lists for GPUs 0..n_gpus-1: equal contiguous shares of `cpus` (default: this process's cores);
    the remainder of an uneven split goes to no GPU (it stays the host's: Redis, the scheduler)."""
    cpus = host_cpus() if cpus is None else list(cpus)
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be ≥ 1, got {n_gpus}")
    if len(cpus) < n_gpus:
        raise ValueError(f"{n_gpus} simulated GPUs cannot each own a core: this process may use {len(cpus)} "
                         f"({format_cpus(cpus)}); run at most {len(cpus)}")
    per = len(cpus) // n_gpus
    return [cpus[g * per : (g + 1) * per] for g in range(n_gpus)]


def format_cpus(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


def parse_cpus(raw: str) -> list[int]:
    """"0,1,4" → [0, 1, 4]; ValueError naming the bad entry."""
    out = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{CPUS_ENV}/--cpus: {part!r} is not a core number (expected e.g. '0,1')")
        out.append(int(part))
    if not out:
        raise ValueError(f"{CPUS_ENV}/--cpus: empty core list")
    return out


def pin(cpus: list[int]) -> None:
    """Run this process (all its threads, and children it starts later) on `cpus` only, with torch's
    intra-op threads matching their number. Call before heavy work starts."""
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(len(cpus))


def pin_process(pid: int, cpus: list[int]) -> None:
    """Move another process (every thread of it) onto `cpus` now: a warm session process still importing
    when it is assigned a GPU, which it reads only once its imports are done."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that just ended
            pass


def pin_from_env() -> list[int] | None:
    """Pin to $TAILSPEC_CPUS when it is set (a session lent on a simulated GPU); the cores, or None."""
    raw = os.environ.get(CPUS_ENV, "").strip()
    if not raw:
        return None
    cpus = parse_cpus(raw)
    pin(cpus)
    return cpus


_AFFINITY_AT_START = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def place_from_env() -> bool:
    """A session process lent on a simulated GPU runs on that GPU's cores only ($TAILSPEC_CPUS, set by the
    dispatcher), within the GPU's share of its core where GPUs share one ($TAILSPEC_CGROUP): the other GPUs'
    rollout tail keeps its own compute. True when it pinned itself to cores."""
    try:
        cpus = pin_from_env()
        cgroup = cpu_quota.join_from_env()
    except (ValueError, OSError) as e:
        print(f"tailspec session: could not pin to the GPU's cores: {e}", file=sys.stderr)
        return False
    if cgroup is not None:
        print(f"tailspec session: CPU quota {cgroup}", flush=True)
    if cpus is not None:
        print(f"tailspec session: pinned to cores {cpus}", flush=True)
    return cpus is not None


def unplace() -> None:
    """The cores the process started with again, and no CPU quota: a session lent without cores (shared
    placement), or a warm session process leaving the last GPU's cores between lends."""
    if _AFFINITY_AT_START is not None and set(os.sched_getaffinity(0)) != _AFFINITY_AT_START:
        os.sched_setaffinity(0, _AFFINITY_AT_START)
    try:
        cpu_quota.leave()
    except OSError:
        pass


def _shares(cfg: TailspecConfig) -> list[Share] | None:
    sc = cfg.scheduler
    if sc.simulated_gpu_cpus != "split":
        return None
    try:
        return shares(sc.simulated_gpus, quota=cpu_quota.root()[0] is not None)
    except ValueError as e:
        log.warning("simulated GPUs share cores: %s", e)
        return None


def simulated_gpu_placement(cfg: TailspecConfig) -> tuple[dict[int, list[int]] | None, dict[int, str] | None]:
    """For simulated GPUs under `scheduler.simulated_gpu_cpus: split`: GPU → its own cores, and GPU → its CPU
    quota's cgroup (made here if missing; scheduler/cpu_quota.py, the demo's workers join the same ones) where
    GPUs share a core. Cores None when shared, or when this host has too few cores for the simulated GPUs (then
    nothing is pinned and the run says so, once); cgroups None with whole cores each."""
    shares = _shares(cfg)
    if shares is None:
        return None, None
    cpus = {g: s.cpus for g, s in enumerate(shares)}
    if shares[0].fraction >= 1:
        return cpus, None
    return cpus, {g: cpu_quota.create(cpu_quota.name_for(cfg.cluster.name, g), s.fraction)
                  for g, s in enumerate(shares)}
