"""The engine's per-step strategy hook and the record of a decode step.

Before every decode step the engine asks its hook `choose_k(batch_size, last) -> k` (k = 0: plain decoding),
so k may change at every step; `last` is the `StepRecord` of the step the engine just ran (None before its
first). After every step the engine makes one `StepRecord`: everything a strategy or an estimator learns from
a step is in it, counted once, by the engine, and never recomputed by a reader.

The rules that choose k (fixed, BEG's table, ReSpec's threshold, the adaptive selector) all live in
`rollout.selector`; this module holds only the contract between them and the engine, so the engine, the
acceptance tracker and the cost model's warm-up depend on it without depending on any rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One decode step of one engine, as the engine measured it (host-side numbers only)."""

    step: int  # 1 for an engine's first decode step, then 2, 3, ...
    rows: int  # running rows (the batch size) of the step
    k: int  # draft length the step ran (0: plain decoding)
    run: int  # consecutive steps at this k, this one included (1: k just changed, or the engine's first step)
    accepted: int  # accepted draft tokens summed over the rows
    reach: tuple[int, ...]  # [j] rows whose draft j was accepted (n_acc > j), j < k; () when k = 0
    seconds: float  # wall time of the step (batch, strategy, drafting, verify, accept, finishing); admission excluded

    @classmethod
    def following(cls, previous: StepRecord | None, rows: int, k: int, accepted: int, reach: Sequence[int],
                  seconds: float) -> StepRecord:
        """The record of the step after `previous` (None: the engine's first): the one place a step's index
        and its run length at k are counted."""
        if previous is None:
            return cls(1, rows, k, 1, accepted, tuple(reach), seconds)
        run = previous.run + 1 if k == previous.k else 1
        return cls(previous.step + 1, rows, k, run, accepted, tuple(reach), seconds)


ChooseK = Callable[[int, "StepRecord | None"], int]
