"""What promotion scores a candidate drafter under: the strategies the rollouts run.

The workers publish each RL step's strategy mix (`core.state.RolloutStats.strategy_mix`: decode steps per
strategy, a chain by its k as "3", a tree by its label). A candidate's score under it is its expected accepted
drafts per target forward, Σ_s w_s · expected_accepted(s, rates): w_s is the share of the speculating decode
steps that ran strategy s (plain decoding drafts nothing, so it weighs nothing), and rates are the candidate's
per-anchor (depth, sibling rank) rates (`drafter_trainer.loss.rank_acceptance_rates`), valued as the engine values
its own (`rollout.strategy.expected_accepted`, trees included). So a drafter whose later siblings the target
takes is credited where the rollouts run trees, and a chain of 4 no longer decides alone.

Before any mix is published (the first promotion), or when the newest step ran no speculation, there is nothing
to weigh: validation scores a chain of `trainer.validation_k`, as it always has.

This lives in the roof because it joins the rollout's strategies and the trainer's validation, components that
never import each other.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from tailspec.core import state
from tailspec.core.state import RolloutStats, StateError
from tailspec.drafter_trainer.promotion import ScoringSource
from tailspec.drafter_trainer.validation import Scoring
from tailspec.rollout.strategy import Strategy, expected_accepted

log = logging.getLogger(__name__)

# Newest entries of the rollout stats stream read to find the newest step's mix: one entry per worker and step,
# or one per step from the RL loop (worker "all").
LOOK_BACK = 64


def latest_mix(redis: Any, cluster: str) -> dict[str, int]:
    """Decode steps per strategy key of the newest RL step in the rollout stats stream: the RL loop's total for
    the step (worker "all") when it published one, else the sum over the workers' entries; {} when none."""
    key = state.key(cluster, "rollout_stats")
    stats = []
    for _, fields in redis.xrevrange(key, max="+", min="-", count=LOOK_BACK):
        try:
            stats.append(state.decode(RolloutStats, fields.get(b"data") or fields.get("data"), where=key))
        except StateError as e:  # one bad writer must not decide what promotion scores
            log.info("skipped a rollout stats entry: %s", e)
    if not stats:
        return {}
    newest = [s for s in stats if s.step == stats[0].step]
    totals = [s for s in newest if s.worker == "all"]
    mix: dict[str, int] = {}
    for s in totals[:1] or newest:
        for k, n in s.strategy_mix.items():
            mix[k] = mix.get(k, 0) + n
    return mix


def mix_weights(mix: Mapping[str, float]) -> dict[str, float]:
    """Strategy label → its share of the speculating decode steps in `mix` (keys: a chain's k, or any label
    `Strategy.parse` reads); plain decoding and unreadable keys left out; {} when nothing speculated."""
    steps: dict[str, float] = {}
    for k, n in mix.items():
        try:
            s = Strategy.parse(str(k))
        except ValueError:
            log.info("strategy mix key %r is no strategy: left out", k)
            continue
        if s.speculates and n > 0:
            steps[s.label] = steps.get(s.label, 0.0) + float(n)
    total = sum(steps.values())
    return {label: n / total for label, n in sorted(steps.items())} if total > 0 else {}


def mix_scoring(weights: Mapping[str, float]) -> Scoring | None:
    """The Scoring of strategy label → weight (as `mix_weights` gives, or as a kept validation recorded it,
    taken as is so that it names the same mix): score(rates) = Σ_s w_s · expected_accepted(s, rates[..., d, r]).
    None for an empty mix."""
    strategies = [(Strategy.parse(label), float(w)) for label, w in weights.items()]
    strategies = [(s, w) for s, w in strategies if s.speculates and w > 0]
    if not strategies:
        return None

    def score(rates: torch.Tensor) -> torch.Tensor:
        def accept(d: int, r: int) -> torch.Tensor:
            return rates[..., d, r]

        return sum(w * expected_accepted(s, accept) for s, w in strategies)

    return Scoring(dict(weights), max(s.depth for s, _ in strategies), max(s.topk for s, _ in strategies), score)


def scoring_source(redis: Any, cluster: str) -> ScoringSource:
    """Promotion's scoring source (drafter_trainer/promotion.py): a kept mix → its Scoring; None → the Scoring of
    the rollouts' newest published mix, or None (a chain of trainer.validation_k) when there is none or it cannot
    be read."""

    def source(kept: dict[str, float] | None) -> Scoring | None:
        if kept is not None:
            return mix_scoring(kept)
        try:
            mix = latest_mix(redis, cluster)
        except Exception as e:  # noqa: BLE001 — the chain of k scores as before; a validation must not fail on it
            log.warning("rollout strategy mix unreadable (%s); scoring a chain of validation_k", e)
            return None
        return mix_scoring(mix_weights(mix))

    return source
