"""Acceptance estimates from real accepted counts: per position and per strategy, exponentially decayed.

Per position j (0-based draft index): alpha_j = P(draft j accepted | drafts 0..j-1 accepted). The engine
reports, after every step with k > 0, how many rows had draft j accepted (`StepRecord.reach`), so a step
at k updates positions 0..k-1 at once: trials_j = rows that reached j, successes_j = rows that passed it.
For a chain drafter the proposal at position j does not depend on k, so alpha_j would predict every strategy:

    E[accepted | k] = sum_{j<k} prod_{i<=j} alpha_i,    E[tokens per row per step | k] = 1 + E[accepted | k].

Per strategy k: the decayed mean of accepted drafts per row actually seen at k, shrunk toward that position
model by `k_weight` rows. It catches what the chain formula misses: stop-token truncation, and on structured
text the regime of the drafts. Where a step starts depends on k (after an all-accepted k = 1 step every other
token was the target's own bonus token), so the positions' rates seen while running one k mis-predict
another (on the task, alpha_0 is lower while running k = 2 than while running k = 1). A strategy's
own mean forgets by rows as steps at its k arrive (it holds about `memory_rows` of its own rows), and by
steps while other strategies run (`other_memory_steps`): what the warm-up and exploration measured for a
strategy run rarely must survive a stretch of another one: counted in rows, a few large-batch steps of the
others would wipe a strategy's warm-up out and leave its estimate on a few dozen rows.
The first `settle_steps` steps after a change of k are still settling into its regime (their acceptance is off
the settled one's, after a change either way): they update the position rates but not the strategy's own mean.
The selector explores in runs of `settle_steps` + 2 steps for this reason: a shorter run would count unsettled
steps, underrate the explored k and keep a slower one.

A strategy run only in explorations holds few rows of its own, so its estimate leans on the position model,
measured in the regime of the strategy that runs most (the counts' `regime`). The regime ratio corrects that
fallback: for each (strategy, regime), what the strategy's settled steps accepted over what the position model
predicted for them, kept over `regime_memory_rows` of the strategy's own rows (it is a property of the drafter
on the text, not of the moment) and shrunk toward 1 by `regime_prior_rows`: without it a k = 1 explored beside
a committed k = 2 rests on a handful of own rows and the k = 2 regime's position rates, and comes out short of
what it accepts. The regime's own strategy takes no ratio
(the counts are its own regime's). The ratio multiplies a model that follows the drafter within `memory_rows`,
so a drop in acceptance still reaches every estimate at once.

Trees (rollout.strategy): a tree's first choice at every node is the chain's draft, so a tree step's rank-0 trials
and acceptances per depth go into the position counts; its later sibling ranks into their own counts per (depth,
rank): P(the rank-r child is accepted | it was drafted), shrunk toward the rate one depth up (at the root toward
`rank_prior`, halved per rank). A tree's expected accepted length is the sum over its nodes of their path's
probability under these rates (`rollout.strategy.expected_accepted`), shrunk toward the tree's own settled mean like
a chain's. The rates multiply along a path as if independent, and they are not: a branch taken after the drafter's
first choice missed continues less well than the first choice does, so the model overrates trees, the more the more
nodes sit off the first-choice path. A tree's regime ratio (as a chain's: its settled steps' accepted drafts over
the model's prediction for them, kept over its own rows) corrects the model toward what it delivers. A dynamic tree
is valued as the static tree of its budget and shape: what it drafts per row is at least as likely, and its own mean
corrects the rest.

Position counts decay by exp(-rows / memory_rows) per informative step (k > 0) that drafts them: the estimate
remembers about `memory_rows` drafted rows whatever the batch size (a batch-1 tail needs more steps than a batch-64
start for the same confidence), and follows the drafter and the policy within that many rows. Positions deeper than
a step drafts (and a tree's sibling ranks, during chain steps) keep their counts: they had no news. Steps at k = 0
carry no information and leave the estimate as it was. A new
drafter version resets the counts (what the old one accepted is not evidence for it) and starts from its own
prior, its validated acceptance when the caller knows it; a new policy version decays the counts by
`policy_decay` (the same drafter against a slightly moved target).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tailspec.rollout.strategy import StepRecord, Strategy, expected_accepted


@dataclass
class AcceptanceTracker:
    k_max: int
    memory_rows: float = 256.0
    prior: float = 0.5  # alpha_0 before any observation
    prior_weight: float = 8.0  # pseudo-trials behind the prior (and behind each position's fallback)
    policy_decay: float = 0.25
    k_weight: float = 16.0  # rows behind the position model in a strategy's estimate (noise must not stick)
    other_memory_steps: float = 256.0  # a strategy's own mean forgets by exp(-1/this) per step of another k
    settle_steps: int = 3  # steps after a change of k that do not count for the strategy's own mean
    regime_memory_rows: float = 2048.0  # a (strategy, regime) ratio forgets by exp(-rows / this) of its own news
    regime_prior_rows: float = 16.0  # rows behind a regime ratio's prior of 1 (a few explored rows must not swing it)
    drafter_version: str | int | None = None
    policy_version: str | int | None = None
    pos_acc: list[float] = field(default_factory=list)
    pos_trials: list[float] = field(default_factory=list)
    k_acc: dict[int, float] = field(default_factory=dict)
    k_rows: dict[int, float] = field(default_factory=dict)
    regime_w: dict[int, float] = field(default_factory=dict)  # k -> decayed trials it put in the position counts
    regime_acc: dict[tuple[int, int], float] = field(default_factory=dict)  # (k, regime) -> settled accepted drafts
    regime_pred: dict[tuple[int, int], float] = field(default_factory=dict)  # (k, regime) -> position model's drafts
    # trees: per (depth d, sibling rank r >= 1) the decayed rows whose node at depth d had a rank-r child and those
    # that accepted it (rank 0 is the position model's: a tree's first choice is the chain's draft)
    rank_acc: dict[tuple[int, int], float] = field(default_factory=dict)
    rank_trials: dict[tuple[int, int], float] = field(default_factory=dict)
    rank_prior: float = 0.15  # P(the rank-1 child is accepted | it was drafted) before any observation; halved per rank
    updates: int = 0
    dropped: int = 0  # inconsistent records refused
    _tokens: list[float] | None = field(default=None, init=False, repr=False)  # expected_tokens by k, until the next change
    _trees: dict = field(default_factory=dict, init=False, repr=False)  # a tree's expected tokens, until the next change

    def __post_init__(self) -> None:
        if self.k_max < 0 or self.settle_steps < 0:
            raise ValueError(f"k_max and settle_steps must be >= 0, got {self.k_max}, {self.settle_steps}")
        if not self.memory_rows > 0 or not self.other_memory_steps > 0 or not 0 <= self.policy_decay <= 1:
            raise ValueError(f"need memory_rows > 0, other_memory_steps > 0 and 0 <= policy_decay <= 1, got "
                             f"{self.memory_rows}, {self.other_memory_steps}, {self.policy_decay}")
        if not 0 <= self.prior <= 1 or self.prior_weight <= 0:
            raise ValueError(f"need prior in [0, 1] and prior_weight > 0, got {self.prior}, {self.prior_weight}")
        if not self.pos_acc:
            self.pos_acc = [0.0] * self.k_max
            self.pos_trials = [0.0] * self.k_max

    # -- updates ---------------------------------------------------------------------------------------------
    def observe(self, record: StepRecord) -> None:
        """Fold one decode step in. A record inconsistent with itself is dropped (a counted no-op)."""
        k, rows, accepted = record.k, record.rows, record.accepted
        if k <= 0:
            return  # plain decoding: nothing to learn
        if record.strategy.is_tree:
            self._observe_tree(record)
            return
        if rows <= 0 or k > self.k_max or not 0 <= accepted <= k * rows:
            self.dropped += 1
            return
        reach = record.reach or None
        if reach is not None and (len(reach) != k or any(not 0 <= r <= rows for r in reach)):
            self.dropped += 1
            reach = None
        settled = record.run > self.settle_steps
        # the position model's prediction for this step before it sees it, for the regime ratio; not while the
        # counts are still mostly the prior (a ratio learned against the prior would stick for regime_memory_rows)
        regime = self.regime() if settled and self.pos_trials[0] >= 4 * self.prior_weight else None
        predicted = rows * self.position_model(k) if regime is not None else 0.0
        self._decay(k, rows)
        if reach is not None:
            self._count_positions(k, rows, reach)
        if settled:
            self.k_acc[k] = self.k_acc.get(k, 0.0) + accepted
            self.k_rows[k] = self.k_rows.get(k, 0.0) + rows
            if regime is not None:
                key, f = (k, regime), math.exp(-rows / self.regime_memory_rows)
                self.regime_acc[key] = self.regime_acc.get(key, 0.0) * f + accepted
                self.regime_pred[key] = self.regime_pred.get(key, 0.0) * f + predicted
        self.updates += 1

    def _observe_tree(self, record: StepRecord) -> None:
        """A tree step: rank 0 at each depth into the position counts (a tree's first choice is the chain's draft),
        the later ranks into the rank counts, the step into the tree's own mean once settled."""
        s, rows, accepted, depth = record.strategy, record.rows, record.accepted, record.k
        trials, acc = record.rank_trials, record.rank_accepted
        ok = rows > 0 and depth <= self.k_max and 0 <= accepted <= depth * rows and len(trials) == len(acc) == depth
        ok = ok and all(len(t) == len(a) and all(0 <= x <= y <= rows for x, y in zip(a, t)) for t, a in zip(trials, acc))
        if not ok:
            self.dropped += 1
            return
        settled = record.run > self.settle_steps
        # the tree model's prediction for this step before it sees it, for the tree's regime ratio (as a chain's)
        regime = self.regime() if settled and self.pos_trials[0] >= 4 * self.prior_weight else None
        predicted = rows * self._tree_model(s) if regime is not None and regime != s else 0.0
        self._decay(s, rows)
        self.regime_w[s] = self.regime_w.get(s, 0.0) + rows
        for d, (t, a) in enumerate(zip(trials, acc)):
            self.pos_trials[d] += t[0]
            self.pos_acc[d] += a[0]
            for r in range(1, len(t)):
                if t[r]:
                    self.rank_trials[(d, r)] = self.rank_trials.get((d, r), 0.0) + t[r]
                    self.rank_acc[(d, r)] = self.rank_acc.get((d, r), 0.0) + a[r]
        if settled:
            self.k_acc[s] = self.k_acc.get(s, 0.0) + accepted
            self.k_rows[s] = self.k_rows.get(s, 0.0) + rows
            if predicted > 0:
                key, f = (s, regime), math.exp(-rows / self.regime_memory_rows)
                self.regime_acc[key] = self.regime_acc.get(key, 0.0) * f + accepted
                self.regime_pred[key] = self.regime_pred.get(key, 0.0) * f + predicted
        self.updates += 1

    def _decay(self, k, rows: int) -> None:
        """Forget before an informative step of strategy k (a chain's k, or a tree) with `rows` rows."""
        d = math.exp(-rows / self.memory_rows)
        d_other = math.exp(-1.0 / self.other_memory_steps)
        # a position the step drafted forgets by its rows, also where few rows reached it: after a drop in
        # acceptance the later positions are rarely reached, and what they measured before must not keep
        # promising long drafts. A position deeper than the step drafts keeps its counts: it had no news, and
        # what it holds is of the current drafter and policy (a new version resets or scales every count).
        # Forgotten, it would fall back to the position before it, which overrates it where a drafter's rates
        # fall with depth (one trained to draft 3 deep accepts less at depth 6 than at 4): a longer strategy
        # explored once would drift back above what it delivers within a few hundred rows of a shorter one
        s = Strategy.of(k)
        depth = s.depth
        for j in range(depth):
            self.pos_acc[j] *= d
            self.pos_trials[j] *= d
        # a strategy's own mean forgets by rows as that strategy brings news, and by steps otherwise
        self._tokens = None
        for key in self.k_acc:
            f = d if key == k else d_other
            self.k_acc[key] *= f
            self.k_rows[key] *= f
        for key in self.regime_w:
            self.regime_w[key] *= d
        if s.is_tree:  # sibling ranks have news from a tree step only (as positions past its depth)
            for key in self.rank_trials:
                if key[0] < depth:
                    self.rank_trials[key] *= d
                    self.rank_acc[key] *= d
        self._trees = {}

    def _count_positions(self, k: int, rows: int, reach: tuple[int, ...]) -> None:
        """Add a step's trials and successes per position (and its weight in the counts' regime)."""
        self.regime_w[k] = self.regime_w.get(k, 0.0) + rows
        trials = rows
        for j, r in enumerate(reach):
            r = min(r, trials)  # reach is non-increasing for prefix acceptance; guard anyway
            self.pos_acc[j] += r
            self.pos_trials[j] += trials
            trials = r
            if trials == 0:
                break

    def set_version(self, drafter_version=None, policy_version=None, prior: float | None = None,
                    carry: float = 0.0) -> bool:
        """Tell the tracker which drafter / policy the next steps run. Returns True if anything changed.
        `prior`: a new drafter's alpha before any observation (its validated acceptance as a chain's alpha,
        `rollout.health_guard.chain_alpha`), used from its reset on; None keeps the current prior. Without it a
        new version starts at the generic prior, which at large batches can make k = 0 look best, and k = 0 steps
        teach the tracker nothing, so the selector would stay there until an exploration run.
        `carry`: the share of the counts a new drafter version keeps (0: a reset). A version trained on from the
        one before it (one co-training lineage) accepts much as its predecessor did on the same rollouts, while
        its validated acceptance is measured offline, under another rule and draft length than the rollout's."""
        if not 0 <= carry <= 1:
            raise ValueError(f"need carry in [0, 1], got {carry}")
        changed = False
        if drafter_version != self.drafter_version:
            if prior is not None:
                if not 0 <= prior <= 1:
                    raise ValueError(f"need prior in [0, 1], got {prior}")
                self.prior = prior
            if carry > 0 and self.drafter_version is not None:
                self.scale(carry)
            else:
                self.reset()
            changed = True
        elif policy_version != self.policy_version:
            self.scale(self.policy_decay)
            changed = True
        self.drafter_version, self.policy_version = drafter_version, policy_version
        return changed

    def scale(self, f: float) -> None:
        self._tokens = None
        self._trees = {}
        self.rank_acc = {key: a * f for key, a in self.rank_acc.items()}
        self.rank_trials = {key: t * f for key, t in self.rank_trials.items()}
        self.pos_acc = [a * f for a in self.pos_acc]
        self.pos_trials = [t * f for t in self.pos_trials]
        self.k_acc = {k: a * f for k, a in self.k_acc.items()}
        self.k_rows = {k: r * f for k, r in self.k_rows.items()}
        self.regime_w = {k: w * f for k, w in self.regime_w.items()}
        self.regime_acc = {key: a * f for key, a in self.regime_acc.items()}
        self.regime_pred = {key: p * f for key, p in self.regime_pred.items()}

    def reset(self) -> None:
        self.scale(0.0)
        self.k_acc, self.k_rows = {}, {}
        self.regime_w, self.regime_acc, self.regime_pred = {}, {}, {}
        self.rank_acc, self.rank_trials = {}, {}
        self.updates = 0

    # -- estimates -------------------------------------------------------------------------------------------
    def alphas(self) -> list[float]:
        """alpha_j for j < k_max; a position with few trials falls back to the one before it."""
        out, fallback, w = [], self.prior, self.prior_weight
        for a, t in zip(self.pos_acc, self.pos_trials):
            alpha = (a + w * fallback) / (t + w)
            out.append(alpha)
            fallback = alpha
        return out

    def regime(self) -> int | None:
        """The strategy whose steps make up most of the position counts now (their regime), None before any."""
        return max(self.regime_w, key=self.regime_w.get) if self.regime_w else None

    def regime_ratio(self, k, regime: int | None = None) -> float:
        """What strategy k's settled steps accepted over what its model predicted for them (a chain's: the position
        model; a tree's: `_tree_model`), while the position counts were in `regime` (default: now), shrunk toward 1
        by `regime_prior_rows` rows at the model's rate."""
        s = Strategy.of(k)
        model = self._tree_model(s) if s.is_tree else self.position_model(s.depth)
        return self._regime_ratio(s, self.regime() if regime is None else regime, model)

    def _regime_ratio(self, k: int, regime: int | None, model: float) -> float:
        """regime_ratio with the position model's E[accepted | k] given (token_table has it in hand)."""
        key, prior = (k, regime), self.regime_prior_rows * max(model, 1e-6)
        return (self.regime_acc.get(key, 0.0) + prior) / (self.regime_pred.get(key, 0.0) + prior)

    def position_model(self, k: int) -> float:
        """E[accepted drafts per row | k] from the per-position rates."""
        total, run = 0.0, 1.0
        for alpha in self.alphas()[:k]:
            run *= alpha
            total += run
        return total

    def expected_accepted(self, k: int) -> float:
        """E[accepted drafts per row | k]: the strategy's own decayed mean, shrunk toward the position model
        by `k_weight` rows."""
        return self.expected_tokens(k) - 1.0

    def expected_tokens(self, k) -> float:
        """E[tokens emitted per row per step] of strategy k (a chain's k or a `Strategy`; 1 for plain decoding)."""
        s = Strategy.of(k)
        if not s.speculates:
            return 1.0
        if s.depth > self.k_max:
            raise ValueError(f"{s.label} is {s.depth} deep; k_max={self.k_max}")
        if not s.is_tree:
            return self.token_table()[s.depth]
        hit = self._trees.get(s)
        if hit is None:
            model, regime = self._tree_model(s), self.regime()
            if regime != s:  # the position and rank counts' independence along a path, corrected as a chain's regime
                model = min(model * self._regime_ratio(s, regime, model), float(s.depth))
            rows = self.k_rows.get(s, 0.0)
            hit = self._trees[s] = 1.0 + (self.k_acc.get(s, 0.0) + self.k_weight * model) / (rows + self.k_weight)
        return hit

    def _tree_model(self, s: Strategy) -> float:
        """E[accepted drafts per row] of tree s from the position rates (rank 0) and the rank rates, independently
        along a path."""
        alphas = self.alphas()
        return expected_accepted(s, lambda d, r: alphas[d] if r == 0 else self.rank_rate(d, r))

    def rank_rate(self, d: int, r: int) -> float:
        """P(the rank-r child of a node at depth d is accepted | it was drafted), r >= 1: its decayed counts shrunk
        toward the rate one depth up (at depth 0 toward `rank_prior`, halved per rank past the first)."""
        rate = self.rank_prior * 0.5 ** (r - 1)
        for j in range(d + 1):
            t = self.rank_trials.get((j, r), 0.0)
            rate = (self.rank_acc.get((j, r), 0.0) + self.prior_weight * rate) / (t + self.prior_weight)
        return rate

    def token_table(self) -> list[float]:
        """1 + E[accepted | k] for k = 0..k_max: each strategy's own mean shrunk toward the position model,
        computed once per change of the counts (the selector reads it for every candidate at every decision;
        recomputing the chain per read cost more than the rest of it)."""
        if self._tokens is None:
            self._tokens = [1.0] + [0.0] * self.k_max
            total, run, regime = 0.0, 1.0, self.regime()
            for k, alpha in enumerate(self.alphas(), start=1):
                run *= alpha
                total += run
                # the regime's own strategy needs no correction: the position counts were measured in its regime
                fallback = total if k == regime else min(total * self._regime_ratio(k, regime, total), float(k))
                rows = self.k_rows.get(k, 0.0)
                self._tokens[k] = 1.0 + (self.k_acc.get(k, 0.0) + self.k_weight * fallback) / (rows + self.k_weight)
        return self._tokens

    def summary(self) -> dict:
        return {
            "alpha": [round(a, 4) for a in self.alphas()],
            "expected_tokens": {k: round(self.expected_tokens(k), 4) for k in range(self.k_max + 1)},
            "trees": {str(s): round(self.expected_tokens(s), 4) for s in self.k_rows if isinstance(s, Strategy) and s.is_tree},
            "updates": self.updates,
        }
