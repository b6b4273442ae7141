"""How the engine prefills the prompts it admits together: each distinct prompt once, in groups of similar length.

One padded forward over every admitted prompt computes rows × longest-prompt positions. RL batches make that
wasteful twice over: a GRPO group repeats its prompt (4-16 samples of each), and prompt lengths are heavy-tailed
(the synthetic task's run 7-145 tokens in one step's 64, so a padded prefill of 16 is ~36% useful). Serving
engines prefill without padding (vLLM's and SGLang's varlen kernels) and share a repeated prompt's KV cache
(automatic prefix caching, RadixAttention). This engine's runner takes rectangular batches, so the plan orders
the rows by length, cuts them where the longest would pad the shortest more than `max_ratio`×, and prefills
only the first row of each distinct prompt; its copies take its cache (and the drafter's state) by a slot copy.
The tokens and distributions are the same either way: a row's prefill does not depend on the rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Chunk:
    """Rows start..start+unique-1 (in plan order) are distinct prompts, prefilled together at `width` (the
    longest of them); rows start+unique..end-1 repeat one of them: `sources[i]` is the row that row
    start+unique+i copies."""

    start: int
    unique: int
    end: int
    width: int
    sources: tuple[int, ...]


def plan(prompts: Sequence[Sequence[int]], max_ratio: float = 2.0) -> tuple[list[int], list[Chunk]]:
    """`order` (row i of the plan is prompts[order[i]]) and the chunks that cover rows 0..len-1 in order."""
    if max_ratio < 1:
        raise ValueError(f"max_ratio must be >= 1, got {max_ratio!r}")
    copies: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        copies.setdefault(tuple(p), []).append(i)
    distinct = sorted(copies.values(), key=lambda idx: (len(prompts[idx[0]]), idx[0]))
    groups: list[list[list[int]]] = []  # chunks of distinct prompts, each a list of its copies' indices
    for idx in distinct:
        n = len(prompts[idx[0]])
        if groups and n <= max_ratio * max(1, len(prompts[groups[-1][0][0]])):
            groups[-1].append(idx)
        else:
            groups.append([idx])
    order: list[int] = []
    chunks: list[Chunk] = []
    for g in groups:
        start = len(order)
        order += [idx[0] for idx in g]
        sources = tuple(start + j for j, idx in enumerate(g) for _ in idx[1:])
        order += [i for idx in g for i in idx[1:]]
        chunks.append(Chunk(start, len(g), len(order), max(len(prompts[idx[0]]) for idx in g), sources))
    return order, chunks
