"""Decode time of rollout replicas under continuous batching, for all replicas at once.

A replica runs at most `max_batch` requests; a finished one is replaced by the next waiting one. Every
running row gains the same expected number of tokens per step (E[tokens | k], k chosen for the batch size by
the engine's selector), so in *progress* (tokens per row since the rollout began) the batch is a list
schedule: request i enters when a slot frees at progress s_i and leaves at s_i + L_i. While requests wait the
batch is full; after the last admission it is the rows still running. Wall time is the integral of the
seconds per token of progress, g(b) = t(b, k_b) / E[tokens | k_b], over progress. Rounding a row's last step
(a step yields whole tokens) and the spread of per-row acceptance are left out: a projection of means.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.selector import AdaptiveSelector
from tailspec.simulate.drafter import FixedAcceptance

_SELECTORS: dict[tuple[int, int], tuple[AdaptiveSelector, FixedAcceptance]] = {}


def k_by_batch(cost: CostModel, acceptance: FixedAcceptance | None, max_batch: int) -> list[int]:
    """k the adaptive selector picks at each batch size 0..max_batch (index 0 unused); all 0 without a drafter.
    One selector per cost model is kept: its candidate strategies depend on the cost table alone."""
    if acceptance is None or acceptance.k_max == 0:
        return [0] * (max_batch + 1)
    key = (id(cost), acceptance.k_max)
    held = _SELECTORS.get(key)
    if held is None or held[0].cost is not cost:
        rates = FixedAcceptance(list(acceptance.tokens))
        ks = [k for k in cost.ks if not k.is_tree and k.depth <= acceptance.k_max]  # the projection's chains
        held = _SELECTORS[key] = (AdaptiveSelector(cost, rates, ks=ks, epsilon=0.0, learn_cost=False), rates)  # type: ignore[arg-type]
    sel, rates = held
    rates.tokens = list(acceptance.tokens)
    return [0] + [int(sel.best(b)) for b in range(1, max_batch + 1)]


def ks_by_batch(cost: CostModel, acceptance: FixedAcceptance | None, max_batch: int,
                fixed_k: int | None = None) -> list[int]:
    """k at each batch size 0..max_batch: the adaptive selector's, or `fixed_k` at every batch size."""
    if fixed_k is not None and acceptance is not None:
        if not 0 <= fixed_k <= acceptance.k_max:
            raise ValueError(f"fixed k={fixed_k} outside 0..{acceptance.k_max}")
        return [fixed_k] * (max_batch + 1)
    return k_by_batch(cost, acceptance, max_batch)


def seconds_per_token(cost: CostModel, acceptance: FixedAcceptance | None, max_batch: int,
                      fixed_k: int | None = None, ks: list[int] | None = None) -> np.ndarray:
    """g[b]: wall seconds per token of per-row progress at batch b (g[0] = 0); k from the adaptive selector,
    or `fixed_k` at every batch size, or `ks` (ks_by_batch's, when the caller has it)."""
    ks = ks_by_batch(cost, acceptance, max_batch, fixed_k) if ks is None else ks
    tokens = acceptance.token_table() if acceptance is not None else [1.0]
    g = np.zeros(max_batch + 1)
    for b in range(1, max_batch + 1):
        g[b] = cost.t(b, ks[b]) / tokens[ks[b]]
    return g


def width_seconds_per_token(attn_s: Callable[[CostModel, int, int], float], cost: CostModel,
                            acceptance: FixedAcceptance | None, max_batch: int,
                            fixed_k: int | None = None, ks: list[int] | None = None) -> np.ndarray:
    """h[b]: seconds per token of per-row progress per position of attention width at batch b (h[0] = 0);
    `attn_s(cost, b, k)` is one step's seconds per position of width; k as in `seconds_per_token`."""
    ks = ks_by_batch(cost, acceptance, max_batch, fixed_k) if ks is None else ks
    tokens = acceptance.token_table() if acceptance is not None else [1.0]
    h = np.zeros(max_batch + 1)
    for b in range(1, max_batch + 1):
        h[b] = attn_s(cost, b, ks[b]) / tokens[ks[b]]
    return h


def finish_times(lengths: np.ndarray, max_batch: int, g: np.ndarray, h: np.ndarray | None = None,
                 ctx0: np.ndarray | None = None, per_row: bool = False) -> np.ndarray:
    """Decode seconds until each request finishes. `lengths` [replicas, requests] in arrival order (0 pads
    a replica with fewer requests); `g` from `seconds_per_token` (length >= max_batch + 1). With `h` (from
    `width_seconds_per_token`) and `ctx0` (each request's attention width at its first step, same shape as
    lengths), every step also pays h(b) per position of the width of its longest running row (the native
    engine: every row attends over the widest row's cache), or with `per_row` h(b) per position of every
    running row's own width (paged attention: each row reads its own context)."""
    lengths = np.asarray(lengths, dtype=float)
    if lengths.ndim != 2:
        raise ValueError(f"lengths must be [replicas, requests], got shape {lengths.shape}")
    r, n = lengths.shape
    m = min(max_batch, n)
    wide = h is not None and ctx0 is not None
    h = h if wide else np.zeros_like(g)
    c0 = np.asarray(ctx0, dtype=float) if wide else np.zeros_like(lengths)
    rows = np.arange(r)
    out = np.empty_like(lengths)
    free = lengths[:, :m].copy()  # per slot: progress at which it frees
    holder = np.tile(np.arange(m), (r, 1))  # per slot: the request in it
    off = c0[:, :m].copy()  # per slot: width of its row minus progress (constant while it runs)
    area = np.zeros(r)  # integral over progress of max(off) (per_row: sum(off)) over the running rows, up to `last`
    lanes = m if per_row else 1  # rows whose width grows with progress in the step's attention cost
    last = np.zeros(r)
    for q in range(m, n):  # admissions while requests wait: the batch stays full
        slot = free.argmin(axis=1)
        start = free[rows, slot]
        # the request leaving the slot finishes here, at full batch: g(m) p + h(m) (lanes p^2 / 2 + area)
        if wide:
            area += (start - last) * (off.sum(axis=1) if per_row else off.max(axis=1))
            out[rows, holder[rows, slot]] = g[m] * start + h[m] * (lanes * start**2 / 2 + area)
            off[rows, slot] = c0[:, q] - start
        else:
            out[rows, holder[rows, slot]] = g[m] * start
        last = start
        free[rows, slot] = start + lengths[:, q]
        holder[rows, slot] = q
    # The m requests still in the slots then finish in order of progress, the batch shrinking by one at each;
    # while j of them are done the widest running row is the widest of the rest (a reverse running max).
    order = np.argsort(free, axis=1, kind="stable")
    tail = np.take_along_axis(free, order, axis=1)
    prev = np.concatenate([last[:, None], tail[:, :-1]], axis=1)
    per_g, per_h = g[m - np.arange(m)], h[m - np.arange(m)]  # batch m, m-1, ..., 1
    seg = (tail - prev) * per_g[None, :]
    if wide:
        rest = np.take_along_axis(off, order, axis=1)[:, ::-1]  # the rows still running, last to finish first
        if per_row:  # the running rows' widths summed: their offsets' suffix sums, one more lane per row
            offs, grow = np.cumsum(rest, axis=1)[:, ::-1], (m - np.arange(m))[None, :]
        else:
            offs, grow = np.maximum.accumulate(rest, axis=1)[:, ::-1], 1
        seg = seg + per_h[None, :] * (grow * (tail**2 - prev**2) / 2 + offs * (tail - prev))
    t0 = g[m] * last + h[m] * (lanes * last**2 / 2 + area)
    out[rows[:, None], np.take_along_axis(holder, order, axis=1)] = t0[:, None] + np.cumsum(seg, axis=1)
    return out
