"""Table selectors: the strategy from a fixed batch-size table, whatever the engine measures. Each is a `Selector`
(rollout.strategy) with `schedule(max_batch)`, and a table is the shape of vLLM's
`num_speculative_tokens_per_batch_size`: (first batch size, last batch size, k) ranges, inclusive, contiguous
from 1. The adaptive selector (rollout/selector.py) builds its schedule the same way.

- `fixed`: one k at every batch size (the cost model's warm-up times each strategy with one).
- `beg`: TLT's fixed default table (draft-token groups 48/32/16/8 on batch ranges starting 1, 2, 5, 21, off
  above 32), mapped onto chain draft lengths as k = round(k_max * tokens / 48).
- `threshold`: ReSpec's two-state gate: k while the batch is at most `gate`, plain decoding above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tailspec.rollout.strategy import StepRecord

Schedule = list[tuple[int, int, int]]  # (first batch size, last batch size, k), inclusive


def merge_schedule(ks_by_batch: Sequence[int]) -> Schedule:
    """[k for batch 1, 2, ...] -> runs of equal k as (start, end, k)."""
    out: Schedule = []
    for b, k in enumerate(ks_by_batch, start=1):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, k))
    return out


@dataclass
class TableSelector:
    """k from a fixed batch-size table; a batch beyond the table's end takes the last range's k."""

    name: str
    table: Schedule

    def __post_init__(self) -> None:
        check_schedule(self.table)

    def __call__(self, batch_size: int, last: StepRecord | None = None) -> int:
        for start, end, k in self.table:
            if start <= batch_size <= end:
                return k
        return self.table[-1][2]

    def schedule(self, max_batch: int) -> Schedule:
        return merge_schedule([self(b) for b in range(1, max_batch + 1)])


def check_schedule(table: Schedule) -> None:
    """Raise ValueError unless the ranges start at 1, are contiguous, inclusive and k >= 0 (vLLM's rules)."""
    if not table:
        raise ValueError("empty schedule")
    expect = 1
    for start, end, k in table:
        if start != expect or end < start or k < 0:
            raise ValueError(f"schedule ranges must be contiguous from 1 with k >= 0; bad entry {(start, end, k)} in {table}")
        expect = end + 1


def fixed_selector(k: int) -> TableSelector:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return TableSelector(f"fixed_k{k}" if isinstance(k, int) else f"fixed_{k.label}", [(1, 1 << 30, k)])


def beg_selector(k_max: int, off_above: int = 32) -> TableSelector:
    """TLT's BEG default table for chain drafting (see the module docstring)."""
    if k_max < 1:
        raise ValueError(f"beg needs k_max >= 1, got {k_max}")
    ranges = [(1, 1, 48), (2, 4, 32), (5, 20, 16), (21, off_above, 8)]
    table = [(s, e, max(1, round(k_max * tokens / 48))) for s, e, tokens in ranges if s <= off_above]
    table[-1] = (table[-1][0], off_above, table[-1][2])
    table.append((off_above + 1, 1 << 30, 0))
    return TableSelector("beg", table)


def threshold_selector(k: int, gate: int = 32) -> TableSelector:
    """ReSpec's gate: speculate with k while the running batch is at most `gate`, else plain decoding."""
    if k < 0 or gate < 1:
        raise ValueError(f"need k >= 0 and gate >= 1, got k={k}, gate={gate}")
    return TableSelector("threshold", [(1, gate, k), (gate + 1, 1 << 30, 0)])
