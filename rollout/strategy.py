"""The per-step strategy hook: `choose_k(batch_size, step_stats) -> k` (k = 0 is plain decoding).

The engine calls it before every decode step, so k may change at every step. The adaptive selector (its
own issue) is one more function of this shape; the simple rules here are the baselines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class StepStats:
    """What the engine knows after the previous step (all host-side numbers; reading them costs nothing)."""

    steps: int = 0  # decode steps so far
    last_batch: int = 0
    last_k: int = 0
    last_run: int = 0  # consecutive steps at last_k, the last one included (1: k just changed)
    last_accepted: int = 0  # accepted draft tokens summed over the batch in the last step
    drafted: int = 0  # totals since the engine started
    accepted: int = 0
    last_reach: list[int] = field(default_factory=list)  # [j] rows whose draft j was accepted (n_acc > j)
    last_step_s: float = 0.0  # wall time of the last decode step (drafting + verify + accept), admission excluded

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


ChooseK = Callable[[int, StepStats], int]


def fixed_k(k: int) -> ChooseK:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return lambda batch_size, stats: k


def batch_threshold(k: int, max_batch: int) -> ChooseK:
    """ReSpec-style gate: speculate with k while the running batch is at most max_batch, else plain decoding."""
    if k < 0 or max_batch < 1:
        raise ValueError(f"need k >= 0 and max_batch >= 1, got k={k}, max_batch={max_batch}")
    return lambda batch_size, stats: k if batch_size <= max_batch else 0
