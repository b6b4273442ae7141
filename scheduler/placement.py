"""Which CPU cores a simulated GPU owns.

On a machine without GPUs each simulated GPU stands for a whole device: its own compute, shared by its
rollout worker and whatever session is lent on it, and by nothing else. So the host's cores are split into
equal contiguous shares, one per simulated GPU, and every process that works "on" a GPU pins itself to its
share (`sched_setaffinity`, and torch's thread count to match). Without the split, a session lent on a
drained GPU trains on the cores the other GPUs' long tail is decoding on, and the miniature measures the
opposite of what the cluster does.

A run that asks for more simulated GPUs than there are cores gets fewer (`gpus_that_fit`): a fractional core
per GPU would need a CPU quota (cgroups), which unprivileged processes cannot set here, and an unsplit
machine breaks the ratio the miniature stands for.
"""

from __future__ import annotations

import os
import sys

CPUS_ENV = "TAILSPEC_CPUS"  # "0,1": the cores the process pins itself to (session processes)


def host_cpus() -> list[int]:
    """The cores this process may run on (its affinity mask, not the machine's count: a container or a
    `taskset` may have narrowed it)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS): every core
        return list(range(os.cpu_count() or 1))


def gpus_that_fit(requested: int, cpus: list[int] | None = None) -> int:
    """How many simulated GPUs get at least one core of their own: min(requested, cores)."""
    return max(1, min(requested, len(host_cpus() if cpus is None else cpus)))


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
