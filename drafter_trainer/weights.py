"""Reward weights w(r) for reward-weighted distillation (ReSpec): which samples the drafter should match best.

Modes (all end the same way: raw weights → divided by their mean (mean 1) → clipped to [w_min, w_max]):
- `reward` (ReSpec's default): raw = r shifted so the lowest reward is 0 when any is negative. With 0/1
  rewards a correct sample weighs 1/accuracy and a wrong one w_min.
- `advantage` (GRPO style): raw = 1 + (r - mean_g) / (std_g + eps) within each group g (samples without a
  group are their own group); a group whose rewards are all equal (e.g. all zero) has advantage 0, raw 1.
- `uniform`: all 1.
A batch whose raw weights are all 0 (e.g. every reward 0 in `reward` mode) carries no preference and gets
uniform weights instead of dividing by zero. Clipping runs after normalization, so the mean is exactly 1
only when nothing is clipped.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

Mode = Literal["reward", "advantage", "uniform"]
EPS = 1e-6
# Rewards larger than this in magnitude are scaled down first: near float64's limit (1.8e308) their differences,
# means and squares overflow to inf and the weights to NaN, and one such sample would make the loss NaN.
SCALE_ABOVE = 1e100


def raw_weights(rewards: Sequence[float], group_ids: Sequence[str | None] | None, mode: Mode) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a flat sequence, got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError("rewards must be finite (validate samples before weighting)")
    peak = float(np.abs(r).max()) if r.size else 0.0
    if peak > SCALE_ABOVE:
        # Every mode's weights are invariant to a positive scale of the rewards (advantage: up to EPS, nothing
        # at this magnitude), so dividing by the peak changes no weight and keeps every step finite.
        r = r / peak
    if mode == "uniform" or r.size == 0:
        return np.ones_like(r)
    if mode == "reward":
        return r - min(0.0, float(r.min()))
    if mode == "advantage":
        groups = list(group_ids) if group_ids is not None else [None] * len(r)
        if len(groups) != len(r):
            raise ValueError(f"{len(groups)} group ids for {len(r)} rewards")
        out = np.ones_like(r)
        by_group: dict[str, list[int]] = {}
        for i, g in enumerate(groups):
            if g is not None:
                by_group.setdefault(g, []).append(i)
        for idx in by_group.values():
            rg = r[idx]
            std = rg.std()
            adv = (rg - rg.mean()) / (std + EPS) if std > 0 else np.zeros_like(rg)
            out[idx] = 1.0 + adv
        return np.maximum(out, 0.0)
    raise ValueError(f"unknown weighting mode {mode!r}; choose reward, advantage or uniform")


def reward_weights(rewards: Sequence[float], group_ids: Sequence[str | None] | None = None,
                   mode: Mode = "reward", w_min: float = 0.1, w_max: float = 5.0) -> np.ndarray:
    """Per-sample weights: raw weights of `mode`, normalized to mean 1, clipped to [w_min, w_max]."""
    if w_min > w_max:
        raise ValueError(f"w_min ({w_min}) must not exceed w_max ({w_max})")
    raw = raw_weights(rewards, group_ids, mode)
    if raw.size == 0:
        return raw
    mean = raw.mean()
    w = raw / mean if mean > EPS else np.ones_like(raw)
    return np.clip(w, w_min, w_max)
