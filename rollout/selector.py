"""Strategy selectors: which strategy (rollout.strategy: none, a chain of k, a static or dynamic tree) to run at
the next decode step, given the running batch size. "k" below names a strategy; an int is a chain's k.

Every selector is a `Selector` (`selector(batch_size, last_step) -> strategy`, what the engine asks before each step) and
exposes `schedule(max_batch)`: the (start, end, strategy) inclusive batch-size ranges it would choose now — for
chains the shape of vLLM's `num_speculative_tokens_per_batch_size`, for the vLLM backend.

- `adaptive`: argmax over strategies of b * E[tokens per row per step | k] / t(b, k) (expected tokens/s), from the
  measured cost model and the online acceptance estimates; epsilon-greedy exploration, three quarters of it
  among the near-ties (candidates whose estimate is within `explore_margin` of the best: those a few percent
  of error can overturn; among them the least known, by the rows behind each estimate, is the likeliest), in
  runs of `explore_run` steps (the acceptance tracker's `settle_steps` + 2) because the first steps after a
  switch still settle into the new strategy's regime; hysteresis (switch only for a clear gain) against
  thrashing on noisy timings, per batch bucket. The estimates fold the noted steps in and the pick is
  re-decided every `decide_every` steps, or at once when the batch size changes. An engine's first
  `cold_steps` steps do not time the cost model (they run slow whatever k). The candidates are the warm-up
  table's, and every `refresh_steps` timed steps they also take in what the online estimates put within the
  margin (not where a graph pool captured the warm-up's alone).
- `fixed`, `beg`, `threshold`: a fixed batch-size table each (rollout/table_selector.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from tailspec.rollout.acceptance import AcceptanceTracker
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.strategy import StepRecord, Strategy
from tailspec.rollout.table_selector import (
    Schedule,
    beg_selector,
    fixed_selector,
    merge_schedule,
    threshold_selector,
)

# -- adaptive ------------------------------------------------------------------------------------------------
ALPHA_MAX = 0.9  # above what EAGLE-3 drafters accept per token; beyond this a strategy is not worth a graph


def geometric_tokens(alpha: float, k: int) -> float:
    """E[tokens per row per step] at draft length k when every draft is accepted with probability alpha."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def model_tokens(alpha: float, strategy) -> float:
    """E[tokens per row per step] of any strategy under a one-parameter drafter: a node's first choice is accepted
    with probability alpha and its rank-r choice with alpha (1 - alpha)^r (each next guess takes a share of what
    the ones before missed); a chain is `geometric_tokens`."""
    s = Strategy.of(strategy)
    if not s.is_tree:
        return geometric_tokens(alpha, s.depth)
    return 1.0 + sum(alpha**d * (1 - alpha) ** r for d, r in _path_powers(s))


@lru_cache(maxsize=256)
def _path_powers(s: Strategy) -> tuple[tuple[int, int], ...]:
    """Per verified node of tree s (a dynamic one as the static tree of its shape, as `expected_accepted` values
    it): (its depth, the sum of its path's sibling ranks), so that under `model_tokens`' drafter its path's
    probability is alpha**depth * (1 - alpha)**ranks (candidate_ks evaluates every tree at 51 alphas)."""
    shape = s if s.kind == "tree" else Strategy.tree(s.branching, s.nodes)
    depth, ranks = [0], [0]
    for parent, rank in zip(shape.parents, shape.ranks):
        depth.append(depth[parent] + 1)
        ranks.append(ranks[parent] + rank)
    return tuple(zip(depth[1:], ranks[1:]))


def candidate_ks(
    cost: CostModel, bucket: int, ks: Sequence | None = None, margin: float = 0.1, alpha_max: float = ALPHA_MAX,
    current: bool = False,
) -> list[Strategy]:
    """The strategies the adaptive selector can pick at this batch bucket: every one within `margin` of the
    best expected tokens/s for some per-token acceptance in [0, alpha_max] (`model_tokens`). Plain decoding is
    always among them (it wins at acceptance 0). Priced by the warm-up table, or with `current` by the cost
    model's estimates now (load and the entries' factors). The graph pool captures exactly the warm-up's, so
    exploration never leaves the plan."""
    ks = [Strategy.of(k) for k in (cost.ks if ks is None else ks)]
    out: set[Strategy] = set()
    times = {k: cost.t(bucket, k) if current else cost.base(bucket, k) for k in ks}
    tokens = {k: _model_table(k, alpha_max) for k in ks}
    for i in range(51):
        scores = {k: tokens[k][i] / times[k] for k in ks}
        best = max(scores.values())
        out.update(k for k, s in scores.items() if s >= best / (1 + margin))
    return sorted(out)


@lru_cache(maxsize=256)
def _model_table(s: Strategy, alpha_max: float) -> tuple[float, ...]:
    """model_tokens of s at candidate_ks' 51 acceptances (the selector re-reads them at every refresh)."""
    return tuple(model_tokens(alpha_max * i / 50, s) for i in range(51))


def _cheaper_first(k: Strategy) -> tuple:
    """Ties go to the strategy that verifies fewer tokens (then the shallower one)."""
    return (-k.nodes, -k.depth)


@dataclass
class Exploration:
    """An exploration run in progress: strategy k for `left` more steps."""

    k: int
    left: int


@dataclass
class Decision:
    """When the committed k is decided again: at another batch size, or after `left` more steps."""

    batch_size: int = 0
    left: int = 0


@dataclass
class AdaptiveSelector:
    cost: CostModel
    acceptance: AcceptanceTracker
    ks: list[int] | None = None  # strategies allowed (default: the cost model's)
    epsilon: float = 0.05  # share of steps that explore
    hysteresis: float = 0.05  # switch only when the best beats the current by this fraction
    margin: float = 0.1  # candidate_ks margin
    explore_margin: float = 0.15  # near-ties: strategies estimated within this of the best
    explore_near: float = 0.75  # share of the explorations that go to the near-ties (when there are any)
    explore_run: int | None = None  # steps per exploration (default: acceptance.settle_steps + 2 counted ones)
    decide_every: int = 8  # steps between decisions at an unchanged batch size (a new batch size decides at once)
    seed: int = 0
    learn_cost: bool = True
    cold_steps: int = 8  # an engine's first steps do not time the cost model (they run slow whatever k)
    # the runner-up's estimate is stale once the cost model's shared load level has moved by more than this share
    # since the runner-up last ran at this bucket: then it is explored at the next decision (0: never)
    stale_load: float = 0.2
    # the candidates also take in, every this many timed steps, those the cost model's estimates now put within
    # `margin` (0: the warm-up's alone, where a graph pool captured exactly those; see `candidates`)
    refresh_steps: int = 64
    name: str = "adaptive"
    k: int | None = None  # the committed strategy at the current batch size's bucket
    committed: dict[int, int] = field(default_factory=dict)  # bucket -> its committed strategy
    switches: int = 0
    explored: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _cands: dict[int, tuple[int, list[Strategy]]] = field(init=False, repr=False, default_factory=dict)  # bucket -> (refresh epoch, candidates)
    _noted: StepRecord | None = field(init=False, repr=False, default=None)  # the last record observed
    _pending: list[StepRecord] = field(init=False, repr=False, default_factory=list)  # observed, not yet folded in
    _exploring: Exploration | None = field(init=False, repr=False, default=None)
    _decision: Decision = field(init=False, repr=False, default_factory=Decision)
    _seen_load: dict[tuple[int, int], float] = field(init=False, repr=False, default_factory=dict)  # (bucket, k) -> load

    def __post_init__(self) -> None:
        if (not 0 <= self.epsilon <= 1 or self.hysteresis < 0 or self.margin < 0 or self.explore_margin < 0
                or not 0 <= self.explore_near <= 1):
            raise ValueError(
                f"need 0 <= epsilon <= 1, hysteresis >= 0, margin >= 0, explore_margin >= 0, 0 <= explore_near <= 1; "
                f"got {self.epsilon}, {self.hysteresis}, {self.margin}, {self.explore_margin}, {self.explore_near}"
            )
        if self.explore_run is None:
            self.explore_run = self.acceptance.settle_steps + 2
        if self.explore_run < 1 or self.decide_every < 1 or self.cold_steps < 0:
            raise ValueError(f"need explore_run >= 1, decide_every >= 1 and cold_steps >= 0, got {self.explore_run}, "
                             f"{self.decide_every}, {self.cold_steps}")
        self.ks = sorted({Strategy.of(k) for k in (self.cost.ks if self.ks is None else self.ks)})
        bad = [k.label for k in self.ks if k not in self.cost.ks or k.depth > self.acceptance.k_max]
        if bad:
            raise ValueError(f"strategies {bad} are not in the cost model {[k.label for k in self.cost.ks]} or exceed "
                             f"k_max={self.acceptance.k_max}")
        if self.stale_load < 0 or self.refresh_steps < 0:
            raise ValueError(f"stale_load and refresh_steps must be >= 0, got {self.stale_load}, {self.refresh_steps}")
        self._rng = random.Random(self.seed)

    # -- estimates -------------------------------------------------------------------------------------------
    def candidates(self, batch_size: int) -> list[Strategy]:
        """The strategies this batch size's bucket may run: the warm-up table's `candidate_ks` (the graph pool's
        plan), and with `refresh_steps` those the online estimates have put within the margin since. A warm-up
        entry timed low on a shared machine can push the strategies that win out of the warm-up's candidates for
        good, and a strategy that is not a candidate is never run, so nothing would correct it."""
        bucket = self.cost.bucket(batch_size)
        epoch = self.cost.observed // self.refresh_steps if self.refresh_steps else 0
        hit = self._cands.get(bucket)
        if hit is not None and hit[0] == epoch:
            return hit[1]
        if hit is None:
            cands = candidate_ks(self.cost, bucket, self.ks, self.margin)
        else:
            cands = sorted(set(hit[1]) | set(candidate_ks(self.cost, bucket, self.ks, self.margin, current=True)))
        self._cands[bucket] = (epoch, cands)
        return cands

    def score(self, batch_size: int, k) -> float:
        """Expected tokens/s of strategy k at this batch size."""
        self.flush()
        return batch_size * self.acceptance.expected_tokens(k) / self.cost.t(batch_size, k)

    def scores(self, batch_size: int) -> dict[Strategy, float]:
        """score() of every candidate at this batch size (one read of the estimates for all of them)."""
        self.flush()
        tokens, t, acc = self.acceptance.token_table(), self.cost.t, self.acceptance
        return {k: batch_size * (acc.expected_tokens(k) if k.is_tree else tokens[k.depth]) / t(batch_size, k)
                for k in self.candidates(batch_size)}

    def best(self, batch_size: int, scores: dict[Strategy, float] | None = None) -> Strategy:
        scores = scores or self.scores(batch_size)
        return max(scores, key=lambda k: (scores[k], *_cheaper_first(k)))

    def observe(self, record: StepRecord) -> None:
        """Note a step an engine ran; `flush` folds it into the estimates at the next decision. The record
        handed again (the engine hands its latest at every call) counts once. Queued rather than folded: the
        fold and the decision then run every `decide_every` steps, outside the steps' hot path."""
        if record is self._noted:
            return
        self._noted = record
        self._pending.append(record)

    def flush(self) -> None:
        """Fold the steps noted since the last flush into the estimates, in order."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for record in pending:
            self.acceptance.observe(record)
            if self.learn_cost and record.rows > 0 and record.step > self.cold_steps:
                # the strategy, not its depth: a tree's step times its own entry, never the chain as deep as it
                self.cost.observe(record.rows, record.strategy, record.seconds)
                self._seen_load[(self.cost.bucket(record.rows), record.strategy)] = self.cost.load

    # -- the choice ------------------------------------------------------------------------------------------
    def __call__(self, batch_size: int, last: StepRecord | None = None) -> int:
        if last is not None:
            self.observe(last)
        cands = self.candidates(batch_size)
        k = self._continue_exploration(cands)
        if k is not None:
            return k
        scores = self._decide(batch_size, cands)
        stale = self._stale_runner_up(batch_size, cands, scores)
        if stale is not None:
            return self._start_exploration(stale)
        if self.epsilon > 0 and len(cands) > 1 and self._rng.random() < self.epsilon / self.explore_run:
            return self._explore(batch_size, cands, scores)
        return self.k

    def _stale_runner_up(self, batch_size: int, cands: list[int], scores: dict[int, float] | None) -> int | None:
        """At a decision: the best-scored other candidate, when its estimate is stale. Every timed step moves the
        cost model's shared load level, so the committed strategy's own warm-up error ends up there (cost_model:
        `observe`) and is passed on to every other estimate: a warm-up entry timed low holds its strategy
        committed, whatever the others would do, until an exploration of them says otherwise, and epsilon-rate
        explorations come too rarely for that. An estimate is stale once the
        load has moved by more than `stale_load` since its strategy last ran here, or since the selector first
        looked at it here: at a bucket not visited before, the load's move so far shifts every estimate alike and
        ranks none wrong, and exploring each runner-up on arrival would slow every new batch size's first steps. One
        exploration run refreshes it, so a stale runner-up costs one run per such move of the load.
        What it does not fix: once the runner-up is committed and its accurate entry brings the load back, the
        mis-measured strategy's factor, learnt relative to the higher load, makes it look better again, and the
        selector can return to it for a while (tests/test_adaptive_selector.py)."""
        if scores is None or self.stale_load <= 0 or self.k is None or len(cands) < 2:
            return None
        others = [k for k in cands if k != self.k]
        k = max(others, key=lambda k: (scores[k], *_cheaper_first(k)))
        seen = self._seen_load.setdefault((self.cost.bucket(batch_size), k), self.cost.load)
        return k if abs(math.log(self.cost.load / seen)) > math.log1p(self.stale_load) else None

    def _continue_exploration(self, cands: list[int]) -> int | None:
        """The next step of the exploration run in progress, while its strategy is a candidate here."""
        run = self._exploring
        if run is None:
            return None
        self._exploring = Exploration(run.k, run.left - 1) if run.left > 1 else None
        if run.k not in cands:
            self._exploring = None
            return None
        self.explored += 1
        return run.k

    def _decide(self, batch_size: int, cands: list[int]) -> dict[int, float] | None:
        """Re-decide the committed k when due (returns the scores it computed, else None)."""
        d, scores = self._decision, None
        if d.left <= 0 or d.batch_size != batch_size or self.k not in cands:
            scores = self.scores(batch_size)
            self.k = self._hysteresis(batch_size, cands, scores)
            d.left = self.decide_every
        d.batch_size, d.left = batch_size, d.left - 1
        return scores

    def _hysteresis(self, batch_size: int, cands: list[int], scores: dict[int, float]) -> int:
        """The batch bucket's committed k, left only for a best that beats it by more than `hysteresis`."""
        bucket, best = self.cost.bucket(batch_size), self.best(batch_size, scores)
        k = self.committed.get(bucket)
        if k not in cands:
            k = best
        elif best != k and scores[best] > (1 + self.hysteresis) * scores[k]:
            k = best
            self.switches += 1
        self.committed[bucket] = k
        return k

    def _explore(self, batch_size: int, cands: list[int], scores: dict[int, float] | None) -> int:
        """Start an exploration run: a near-tie (by how little is known of it) or, else, any other candidate."""
        scores = scores or self.scores(batch_size)
        others = [k for k in cands if k != self.k]
        top = max(scores.values())
        near = [k for k in others if scores[k] * (1 + self.explore_margin) >= top]
        if near and self._rng.random() < self.explore_near:
            k = self._least_known(batch_size, near)
        else:
            k = self._rng.choice(others)
        return self._start_exploration(k)

    def _start_exploration(self, k: int) -> int:
        self.explored += 1
        self._exploring = Exploration(k, self.explore_run - 1) if self.explore_run > 1 else None
        return k

    def _least_known(self, batch_size: int, ks: list[int]) -> int:
        """One of `ks`, drawn with weight 1 / (rows behind its own estimate + k_weight): the near-tie whose
        estimate rests least on its own measurements is the likeliest to be wrong. A strategy's own rows are
        its settled steps' (the rest of its estimate is the position model, measured in another regime); for
        k = 0 the acceptance is exact and its rows are those of its timed steps."""
        kw = self.acceptance.k_weight
        rows = [self.acceptance.k_rows.get(k, 0.0) if k > 0 else self.cost.samples(batch_size, 0) * batch_size for k in ks]
        return self._rng.choices(ks, weights=[1.0 / (r + kw) for r in rows])[0]

    def schedule(self, max_batch: int) -> Schedule:
        """What it would pick now (no exploration, no hysteresis) for every batch size 1..max_batch."""
        return merge_schedule([self.best(b) for b in range(1, max_batch + 1)])


def make_selector(
    rollout_config,
    cost: CostModel | None = None,
    acceptance: AcceptanceTracker | None = None,
    *,
    gate: int = 32,
    seed: int = 0,
    planned: bool = False,
):
    """The selector named by `rollout.selector` (adaptive | fixed | beg | threshold).

    adaptive needs the cost model measured on this engine (`cost_model.measure`); an acceptance tracker is
    made if none is given. `planned`: a graph pool captured the warm-up's candidates, so adaptive keeps to them
    (`AdaptiveSelector.refresh_steps` 0). With `rollout.drafter: none` every selector is plain decoding.
    """
    cfg = rollout_config
    name = cfg.selector
    if cfg.drafter == "none":
        return fixed_selector(0)
    if name == "fixed":
        return fixed_selector(min(cfg.k, cfg.k_max))
    if name == "beg":
        return beg_selector(cfg.k_max)
    if name == "threshold":
        return threshold_selector(min(cfg.k, cfg.k_max), gate)
    if name == "adaptive":
        if cost is None:
            raise ValueError(
                "rollout.selector=adaptive needs a cost model: measure one on the engine with "
                "tailspec.rollout.cost_model.measure(engine, prompts), or choose fixed|beg|threshold"
            )
        acceptance = acceptance or AcceptanceTracker(k_max=cfg.k_max)
        return AdaptiveSelector(cost, acceptance, ks=[k for k in cost.ks if k.depth <= cfg.k_max], epsilon=cfg.epsilon,
                                seed=seed, **({"refresh_steps": 0} if planned else {}))
    raise ValueError(f"unknown rollout.selector {name!r}; choose adaptive, fixed, beg or threshold")
