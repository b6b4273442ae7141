"""The records of one `tailspec bench scheduler` run: its shape (the arguments resolved), its fixed parts and what
the scripted rollout measured. The bench (benchmarks/scheduler.py) makes them; its figures and report
(benchmarks/scheduler_report.py) read them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Shape:
    """What the arguments ask for, their defaults resolved."""

    workers: int
    gpus: int
    per_worker: int  # GPUs per worker: each worker is a tensor-parallel replica
    per_node: int | None
    session: str  # real | busy | none
    hours: float  # hours' worth of samples written after the rollout
    nodes: dict[str, int]

    @property
    def warm(self) -> int:
        return 0 if self.session == "none" else min(64, self.gpus)

    @property
    def one_node(self) -> bool:
        return len(self.nodes) == 1


@dataclass
class Run:
    """One bench run's fixed parts: the shape, the Redis and cluster it runs in, the task's response lengths, the
    real sessions' policy and samples, and its temp directory (config, session logs, the scheduler's stats)."""

    args: argparse.Namespace
    shape: Shape
    url: str
    cluster: str
    r: Any  # redis.Redis
    lengths: list[int]
    tmp: Path
    policy_dir: Path | None
    samples: list
    out: Any

    @property
    def logs(self) -> Path:
        return self.tmp / "sessions"

    @property
    def stats_path(self) -> Path:
        return self.tmp / "ticks.json"


@dataclass
class Rollout:
    """The scripted rollout against the running scheduler, and what the scheduler spent meanwhile."""

    sim: Any  # scheduler.scripted_rollout's ScriptedResult
    scheduler_cpu_s: float
    wall: float
    t_start: float
    t_end: float
    progress_written: int
    monitor_cpu_s: float | None
