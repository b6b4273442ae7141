"""Scoring drafters on held-out samples: the expected acceptance length of one drafter (`validate`), or of a
candidate and the current version on the same samples with one teacher pass (`validate_paired`, resumable across
sessions by sample key), and the paired test that decides a promotion (`decide`, Student t). versions.py's module
doc says why the unit is a held-out sample and what the test guarantees.

What a drafter is scored under: a chain of k by default (loss.acceptance_rates / expected_length), or a `score`
over the per-anchor rates of each (depth, sibling rank) (loss.rank_acceptance_rates), which the roof builds from
the strategies the rollouts run (`Scoring`; tailspec/mix_score.py): a drafter good at its first choice and one good
at its later siblings rank differently under trees, and promotion must rank them as the engine spends."""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from tailspec.core.state import Sample
from tailspec.drafter_trainer.loss import acceptance_rates, expected_length, rank_acceptance_rates
from tailspec.drafter_trainer.model import Eagle3Module
from tailspec.drafter_trainer.teacher import Teacher, collate

Rates = Callable[[torch.Tensor], torch.Tensor]  # rates [B, A, depth, ranks] → expected accepted drafts [B, A]


@dataclass(frozen=True)
class Scoring:
    """A candidate's scoring under the strategies the rollouts run, built in the roof (drafter_trainer knows no
    strategies): `mix` is what the version records as `scored_under` (strategy label → weight), `score` values
    loss.rank_acceptance_rates' rates of `depth` x `ranks`."""

    mix: dict[str, float]
    depth: int
    ranks: int
    score: Rates


@dataclass
class Validation:
    acceptance_length: float  # mean over valid anchors of 1 + expected accepted drafts (a chain of k: E_k)
    alpha: list[float]  # mean per-position acceptance probability α_1..α_k (scored: the depths' rank-0 rates)
    anchors: int
    k: int
    rank_rates: list[list[float]] | None = None  # scored: mean rate per [depth][rank] over the valid anchors


@dataclass
class Paired:
    candidate: list[float]  # per held-out sample: mean expected acceptance length over its anchors
    current: list[float]
    weights: list[int]  # anchors per sample
    k: int
    stopped_early: bool = False  # the interim look promoted: not every sample was scored
    # scored: the candidate's mean rate per [depth][rank] over the anchors this call scored (None: it scored none)
    rank_rates: list[list[float]] | None = None

    @property
    def gains(self) -> list[float]:
        return [a - b for a, b in zip(self.candidate, self.current)]

    @property
    def anchors(self) -> int:
        return sum(self.weights)

    def mean(self, which: str) -> float:
        """Anchor-weighted mean: the same figure `validate` reports."""
        xs = self.candidate if which == "candidate" else self.current
        return sum(x * w for x, w in zip(xs, self.weights)) / self.anchors


@dataclass
class Decision:
    promote: bool
    pairs: int
    gain_mean: float
    gain_lcb: float
    reason: str


def t_cdf(t: float, df: float) -> float:
    """Student t distribution function (regularized incomplete beta; no scipy in the core install)."""
    x = df / (df + t * t)
    tail = 0.5 * _betai(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=256)
def t_ppf(p: float, df: float) -> float:
    """Quantile of Student t by bisection on t_cdf (|error| < 1e-9); cached: a run asks for few (p, df)."""
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _betai(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    # Lentz's continued fraction for the incomplete beta function.
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1) * (a + m2)), -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def decide(gains: Sequence[float], level: float = 0.05, min_pairs: int = 16) -> Decision:
    """Promote when the one-sided (1 − level) lower confidence bound of the mean paired gain is > 0."""
    n = len(gains)
    mean = sum(gains) / n if n else 0.0
    if n < max(2, min_pairs):
        return Decision(False, n, mean, float("-inf"), f"too few held-out samples ({n} < {min_pairs})")
    sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / (n - 1))
    lcb = mean - t_ppf(1.0 - level, n - 1) * sd / math.sqrt(n)
    if lcb > 0:
        return Decision(True, n, mean, lcb, f"paired gain {mean:+.4f}, {100 * (1 - level):g}% lower bound {lcb:+.4f} > 0")
    return Decision(False, n, mean, lcb, f"paired gain {mean:+.4f}, {100 * (1 - level):g}% lower bound {lcb:+.4f} <= 0")


def _teacher_batches(teacher: Teacher, samples: Sequence[Sample], batch_size: int,
                     check: Callable[[], None] | None) -> Iterator[tuple[Any, Any, list[Sample]]]:
    """(batch, teacher output, its samples) per `batch_size` samples, taken in order of length so a batch pads little (the
    teacher's forward and the drafter's unroll grow with the padded width; scores are per sample, so the order
    does not change them); `check` runs before each and inside the teacher's forward (a session's stop check)."""
    ordered = sorted(samples, key=lambda x: len(x.prompt_ids) + len(x.response_ids))
    for s in range(0, len(ordered), batch_size):
        if check is not None:
            check()
        part = ordered[s : s + batch_size]
        batch = collate(part).to(teacher.device)
        yield batch, teacher(batch, check), part


def sample_key(sample: Sample) -> str:
    """A held-out sample's identity across processes (its policy version and tokens)."""
    h = hashlib.blake2b(digest_size=10)
    h.update(f"{sample.policy_version}|{sample.prompt_ids}|{sample.response_ids}".encode())
    return h.hexdigest()


Score = tuple[float, float, int]  # (candidate, current, anchors) of one held-out sample


def _per_anchor(drafter: Eagle3Module, batch: Any, out: Any, k: int, temperature: float, score: Rates | None,
                depth: int | None, ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expected tokens per target forward [B, A], valid [B, A], the rates they come from): a chain of k's α
    [B, A, k] without a score, else the (depth, rank) rates [B, A, depth, ranks] and 1 + score of them."""
    if score is None:
        alpha, valid = acceptance_rates(drafter, out.aux, out.logits, batch.ids, batch.lengths, batch.prompt_lens,
                                        k, temperature)
        return expected_length(alpha), valid, alpha
    rates, valid = rank_acceptance_rates(drafter, out.aux, out.logits, batch.ids, batch.lengths, batch.prompt_lens,
                                         depth or k, ranks, temperature)
    return 1.0 + score(rates), valid, rates


def pick_holdout(holdout: Sequence[Sample], done: dict[str, Score], n: int | None) -> list[Sample]:
    """The held-out samples (oldest first in `holdout`) of a validation of `n` samples, `done` of them scored
    already by a resumed validation, here or since gone from the buffer: those still here, then the newest
    others, as many as `n` leaves. Without counting what was scored, a validation that spans RL steps would
    chase the newest samples and never finish: each step brings as many new held-out samples as a lend scores."""
    if n is None:
        return list(holdout)
    scored = [x for x in holdout if sample_key(x) in done][-n:]
    others = [x for x in holdout if sample_key(x) not in done]
    left = n - len(done)  # `scored` are among `done`
    return scored + (others[-left:] if left > 0 else [])


@torch.no_grad()
def validate_paired(candidate: Eagle3Module, current: Eagle3Module, teacher: Teacher, samples: Sequence[Sample],
                    k: int = 4, batch_size: int = 32, temperature: float = 1.0,
                    check: Callable[[], None] | None = None, done: dict[str, Score] | None = None,
                    on_batch: Callable[[dict[str, Score]], None] | None = None,
                    look_at: int = 0, look: Callable[[list[float]], bool] | None = None,
                    score: Rates | None = None, depth: int | None = None, ranks: int = 1) -> Paired:
    """Per held-out sample scores of both drafters from ONE teacher forward per batch (same anchors): the mean
    over its valid anchors of the expected tokens per target forward, at a chain of k, or with `score` 1 + score
    of the anchors' rates at `depth` (default k) x `ranks` (loss.rank_acceptance_rates).

    Resumable: samples whose scores are in `done` (by sample_key) are not scored again, and `on_batch` gets each
    batch's new scores as soon as they exist, so a validation cut short by a stop keeps what it finished.

    Interim look: the batch that first brings the scored samples to `look_at` or more hands their gains to
    `look`, and True ends the validation there (`Paired.stopped_early`). A call that starts with `look_at`
    scored already does not look: the count only grows, so a validation resumed across sessions looks once."""
    done = dict(done or {})
    keys = [sample_key(x) for x in samples]
    # pairs scored in earlier lends on samples since gone from the held-out set still count (versions.py: _progress)
    keys += sorted(set(done) - set(keys))
    todo = [x for x, key in zip(samples, keys) if key not in done]
    looking = look is not None and len(_scored(keys, done)) < look_at
    stopped = False
    table, anchors = None, 0  # the candidate's rates summed over the valid anchors scored here
    modes = (candidate.training, current.training)
    candidate.eval()
    current.eval()
    try:
        for batch, out, part in _teacher_batches(teacher, todo, batch_size, check):
            scores = []
            for d in (candidate, current):
                if check is not None:  # each drafter's unroll costs about what the teacher's forward does
                    check()
                e, valid, rates = _per_anchor(d, batch, out, k, temperature, score, depth, ranks)
                e = e.double() * valid
                scores.append((e.sum(1) / valid.sum(1).clamp(min=1)).tolist())
                if score is not None and d is candidate:
                    got = rates[valid].double().sum(0).cpu()
                    table, anchors = (got if table is None else table + got), anchors + int(valid.sum())
            counts = valid.sum(1).tolist()
            new = {sample_key(x): (a, b, int(c)) for x, a, b, c in zip(part, scores[0], scores[1], counts)}
            done.update(new)
            if on_batch is not None:
                on_batch(new)
            if looking and len(rows := _scored(keys, done)) >= look_at:
                looking = False
                if look([r[0] - r[1] for r in rows]):
                    stopped = True
                    break
    finally:
        candidate.train(modes[0])
        current.train(modes[1])
    rows = _scored(keys, done)
    if not rows:
        raise ValueError(f"no held-out sample is long enough to validate at k={depth or k if score else k}")
    mean = (table / anchors).tolist() if table is not None and anchors else None
    return Paired([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], k, stopped, mean)


def _scored(keys: Sequence[str], done: dict[str, Score]) -> list[Score]:
    """The scores of the samples `keys` names that are in `done` and have anchors, in the order of `keys`."""
    rows = (done.get(key) for key in keys)
    return [r for r in rows if r is not None and r[2] > 0]


# A session validating on a lent GPU checks its lease before each teacher batch; batches of 4 held-out samples
# of similar length bound how long a revoked session keeps it, and pad less than 8 (32 samples of the deep
# policy on one core: 2.3 s in batches of 8, 1.3 s in batches of 4, both sorted; 3.9 s unsorted in 8).
CHECKED_BATCH = 4


@torch.no_grad()
def validate(drafter: Eagle3Module, teacher: Teacher, samples: Sequence[Sample], k: int = 4,
             batch_size: int = 32, temperature: float = 1.0, check: Callable[[], None] | None = None,
             score: Rates | None = None, depth: int | None = None, ranks: int = 1) -> Validation:
    """Expected acceptance length on `samples`: at chain length k (see loss.acceptance_rates), or with `score`
    the mean of 1 + score of the anchors' rates at `depth` (default k) x `ranks` (loss.rank_acceptance_rates).
    `check` is called between batches (a session's stop check: it raises to abandon the validation)."""
    was_training = drafter.training
    drafter.eval()
    total_e, total_a, n = 0.0, 0.0, 0
    try:
        for batch, out, _ in _teacher_batches(teacher, samples, batch_size, check):
            e, valid, rates = _per_anchor(drafter, batch, out, k, temperature, score, depth, ranks)
            total_e += float(e[valid].double().sum())
            total_a = total_a + rates[valid].double().sum(0).cpu()
            n += int(valid.sum())
    finally:
        drafter.train(was_training)
    if n == 0:
        raise ValueError(f"no held-out sample is long enough to validate at k={depth or k if score else k}")
    mean = total_a / n
    if score is None:
        return Validation(total_e / n, mean.tolist(), n, k)
    return Validation(total_e / n, mean[:, 0].tolist(), n, k, mean.tolist())
