"""Step-time cost model t(b, k): seconds of one decode step (drafting + verify + accept) of strategy k at batch b.

A strategy is a `rollout.strategy.Strategy` (an int is a chain's k): the table has a column per strategy, chains
and trees alike, each timed on the real engine.

Measured at warm-up on the real engine (`measure`), then kept current from the engine's own steps
(`observe`): the machine's speed drifts (other jobs, clocks, context growth through the rollout), so the
warm-up table is the shape, a shared `load` level follows the machine, and a per-(bucket, k) factor
corrects each entry. The factor is a decayed mean of that entry's own observed log-ratios with the warm-up
table counted as `prior_steps` observations: a handful of explored steps fix a warm-up entry that a burst
of noise spoiled (a slow EMA needed dozens, and a strategy the selector rarely runs never got them).

Lookup between measured batch buckets interpolates linearly in b: a step's cost is close to affine in the
batch (fixed launch/dispatch cost + per-row work) between neighbouring buckets. On a GPU with a graph pool
the real cost of b is the cost of its padded bucket; the interpolation then slightly under-estimates, which
the online factor for that bucket absorbs.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from tailspec.rollout.sequence import SamplingParams
from tailspec.rollout.strategy import Strategy
from tailspec.rollout.table_selector import fixed_selector


def default_buckets(max_batch: int) -> list[int]:
    """Batch buckets: 1, 2, 4, 8, then every 8 up to 32, then every 16 (nano-vllm / TLT capture lists)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [b for b in (1, 2, 4) if b < max_batch]
    out += [b for b in range(8, min(32, max_batch) + 1, 8)]
    out += [b for b in range(48, max_batch + 1, 16)]
    out = sorted({b for b in out if b <= max_batch} | {max_batch})
    return out


def _json_key(k: Strategy) -> int | str:
    return k.label if k.is_tree else k.depth


# The trees the main job's selector may pick beside the chains (rollout.strategy labels): one alternative at the
# root of a chain of 4, two at the first two levels of a chain of 5, and two EAGLE-2 dynamic trees (6 levels of 2,
# 10 nodes verified; 8 levels of 4, 32 nodes: TLT's shape below its 48). Trees only pay where the batch is small:
# they are timed at the warm-up's buckets up to TREE_MAX_BATCH.
DEFAULT_TREES = ("tree2-1-1-1n5", "tree2-2-1-1-1n7", "dyn6x2n10", "dyn8x4n32")
TREE_MAX_BATCH = 16


def default_strategies(k_max: int, trees: bool = True, max_nodes: int = 128) -> list[Strategy]:
    """The main job's strategy space: the chains of `default_ks`, and where the drafter drafts trees the
    DEFAULT_TREES no deeper than k_max and drafting at most max_nodes nodes."""
    out = [Strategy.of(k) for k in default_ks(k_max)]
    if trees:
        for label in DEFAULT_TREES:
            s = Strategy.parse(label)
            drafted = s.full_nodes if s.kind == "dynamic" else s.nodes
            if s.depth <= k_max and drafted <= max_nodes:
                out.append(s)
    return sorted(out)


def default_ks(k_max: int) -> list[int]:
    """Strategies (draft lengths) worth a cost-table column: 0..4, then 6, 8, 12, 16 up to k_max."""
    if k_max < 0:
        raise ValueError(f"k_max must be >= 0, got {k_max}")
    return sorted({k for k in (0, 1, 2, 3, 4, 6, 8, 12, 16) if k <= k_max} | {k_max})


@dataclass
class CostModel:
    """t(b, k) from a warm-up table over `buckets` x `ks`, times an online correction per (bucket, k)."""

    buckets: list[int]
    ks: list[Strategy]  # the strategies with a column (ints given here are chains' k), sorted
    table: dict[tuple[int, Strategy], float]  # (bucket, strategy) -> seconds per step at warm-up
    ema: float = 0.05  # weight of one observation in the shared load level
    clip: float = 2.0  # one observation counts as at most this ratio (noise, GC pauses, preemption)
    prior_steps: float = 4.0  # the warm-up entry weighs as much as this many online steps of its shape
    memory_steps: float = 64.0  # an entry's online observations decay by exp(-1/memory_steps) per new one
    factor: dict[tuple[int, int], float] = field(default_factory=dict)
    load: float = 1.0  # machine-wide level: every observation moves it, so strategies not run lately follow too
    observed: int = 0
    _logsum: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _n: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)
    _base: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict, repr=False)  # (b, k) -> (bucket, base)

    def __post_init__(self) -> None:
        if not self.buckets or sorted(set(self.buckets)) != list(self.buckets) or self.buckets[0] < 1:
            raise ValueError(f"buckets must be strictly increasing batch sizes >= 1, got {self.buckets}")
        try:
            ks = [Strategy.of(k) for k in self.ks]
            self.table = {(b, Strategy.of(k)): v for (b, k), v in self.table.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"cost model strategies must be draft lengths >= 0 or strategies: {e}") from e
        if not ks or sorted(set(ks)) != ks:
            raise ValueError(f"ks must be strictly increasing strategies (draft lengths >= 0), got {self.ks}")
        self.ks = ks
        self._chains = [k for k in ks if not k.is_tree]
        missing = [(b, k) for b in self.buckets for k in self.ks if (b, k) not in self.table]
        if missing:
            raise ValueError(f"cost table misses (bucket, k) entries: {missing[:6]}")
        bad = [(key, v) for key, v in self.table.items() if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))]
        if bad:
            raise ValueError(f"cost table entries must be finite seconds > 0, got {bad[:4]}")
        if not 0 < self.ema <= 1 or self.clip < 1:
            raise ValueError(f"need 0 < ema <= 1 and clip >= 1, got ema={self.ema}, clip={self.clip}")
        if not self.prior_steps > 0 or not self.memory_steps > 0:
            raise ValueError(f"need prior_steps > 0 and memory_steps > 0, got {self.prior_steps}, {self.memory_steps}")

    # -- lookup ----------------------------------------------------------------------------------------------
    def bucket(self, b: int) -> int:
        """The smallest bucket >= b (the padded graph shape); the largest bucket for b beyond it."""
        i = bisect.bisect_left(self.buckets, b)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def base(self, b: int, k) -> float:
        """Warm-up table interpolated linearly in b (and, for a chain between chain columns, in k)."""
        k = Strategy.of(k)
        if k not in self.ks:
            chains = self._chains
            i = bisect.bisect_left(chains, k)
            if k.is_tree or i == 0 or i == len(chains):
                raise ValueError(f"{k.label} outside the measured strategies {[s.label for s in self.ks]}")
            k0, k1 = chains[i - 1], chains[i]
            w = (k.depth - k0.depth) / (k1.depth - k0.depth)
            return (1 - w) * self.base(b, k0) + w * self.base(b, k1)
        bs = self.buckets
        if b <= bs[0]:
            return self.table[(bs[0], k)]
        if b >= bs[-1]:
            if len(bs) == 1:
                return self.table[(bs[0], k)] * b / bs[0]
            # extrapolate with the last segment's slope (never below the last measured value)
            b0, b1 = bs[-2], bs[-1]
            slope = (self.table[(b1, k)] - self.table[(b0, k)]) / (b1 - b0)
            return self.table[(b1, k)] + max(slope, 0.0) * (b - b1)
        i = bisect.bisect_left(bs, b)
        if bs[i] == b:
            return self.table[(b, k)]
        b0, b1 = bs[i - 1], bs[i]
        w = (b - b0) / (b1 - b0)
        return (1 - w) * self.table[(b0, k)] + w * self.table[(b1, k)]

    def t(self, b: int, k: int) -> float:
        """Predicted seconds of one decode step at batch b with draft length k."""
        bucket, base = self._lookup(b, k)
        return base * self.load * self.factor.get((bucket, k), 1.0)

    def _lookup(self, b: int, k: int) -> tuple[int, float]:
        """(bucket(b), base(b, k)), computed once per shape: the table never changes after construction."""
        hit = self._base.get((b, k))
        if hit is None:
            hit = self._base[(b, k)] = (self.bucket(b), self.base(b, k))
        return hit

    # -- online refresh ----------------------------------------------------------------------------------------
    def observe(self, b: int, k, seconds: float) -> None:
        """Fold one real step's wall time into the (bucket(b), k) correction factor. Bad values are dropped."""
        if b < 1 or k not in self.ks or not (seconds > 0 and math.isfinite(seconds)):
            return
        bucket, base = self._lookup(b, k)
        key = (bucket, k)
        # in log space (a ratio of 2 and one of 1/2 cancel): the shared load level follows the ratio of
        # every observed step to its warm-up entry (slowly: what the strategies being run say about the
        # machine), then this entry's factor becomes the decayed mean of its own ratios to base * load,
        # shrunk toward 1 (the warm-up table) by prior_steps. So an entry's factor is its time relative to
        # the strategies run around it, which drift on a shared machine does not move; the price is that
        # the committed entry's own warm-up error moves into the load, and only exploring the others
        # corrects their estimates relative to it
        ratio = min(max(seconds / (base * self.load), 1 / self.clip), self.clip)
        self.load *= ratio ** (self.ema / 2)
        own = min(max(math.log(seconds / (base * self.load)), -math.log(self.clip)), math.log(self.clip))
        d = math.exp(-1.0 / self.memory_steps)
        self._logsum[key] = self._logsum.get(key, 0.0) * d + own
        self._n[key] = self._n.get(key, 0.0) * d + 1.0
        self.factor[key] = math.exp(self._logsum[key] / (self._n[key] + self.prior_steps))
        self.observed += 1

    def samples(self, b: int, k: int) -> float:
        """Decayed count of the online observations behind t(b, k)'s factor (0: the warm-up table alone)."""
        return self._n.get((self.bucket(b), k), 0.0)

    def monotone(self) -> CostModel:
        """Project the table onto costs non-decreasing in b and, among chains, in k: t(b, k) = min over b' >= b,
        chains k' >= k (a tree is only bounded by its own larger batches: no order of trees is a cost order).

        More rows or more drafts never cost less, and timing noise on a shared machine is one-sided
        (preemption only adds time), so every measurement is an upper bound on the true cost of itself and
        of every smaller shape: the smallest such bound is the better estimate.
        """
        t = dict(self.table)
        chains = self._chains
        for b in reversed(self.buckets):
            for k in reversed(self.ks):
                nb = [t[(b2, k)] for b2 in self.buckets if b2 > b][:1]
                i = chains.index(k) if not k.is_tree else -1
                nk = [t[(b, chains[i + 1])]] if 0 <= i < len(chains) - 1 else []
                t[(b, k)] = min([t[(b, k)], *nb, *nk])
        return CostModel(list(self.buckets), list(self.ks), t, self.ema, self.clip, self.prior_steps, self.memory_steps)

    # -- (de)serialisation: JSON-friendly, for logs and the benchmark ---------------------------------------
    def to_dict(self) -> dict:
        """A chain's column is its k (an int), a tree's its label."""
        return {
            "buckets": list(self.buckets),
            "ks": [_json_key(k) for k in self.ks],
            "table": [[b, _json_key(k), self.table[(b, k)]] for b in self.buckets for k in self.ks],
        }

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        try:
            table = {(int(b), Strategy.of(k)): float(t) for b, k, t in d["table"]}
            return cls(list(map(int, d["buckets"])), [Strategy.of(k) for k in d["ks"]], table)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed cost model: {e}") from e


def measure(
    engine,
    prompts: Sequence[Sequence[int]],
    buckets: Sequence[int] | None = None,
    ks: Sequence[int] | None = None,
    steps: int = 5,
    temperature: float = 1.0,
    passes: int = 1,
    on_step=None,
    block: int = 6,
    max_tokens: int = 256,
    settle: int = 6,
    rows: int = 48,
    tree_max_batch: int = TREE_MAX_BATCH,
) -> CostModel:
    """Warm-up: time `steps` decode steps of the real engine at every (bucket, k), keep the median; a small
    bucket times enough steps for `rows` rows (batch 1: 48 at the default). Trees are timed at buckets up to
    `tree_max_batch` only (`extend_trees` fills the larger ones).

    Per bucket, one batch of `bucket` requests runs like a rollout: a request that stops is replaced at once by
    the next prompt (cycled, each with its own seed), so the batch stays full and its rows sit at every depth of
    their responses. The strategies take turns on it: `settle` untimed steps at k, then `block` timed ones,
    round after round, each round's order the reverse of the last, until every k has its steps (admissions'
    prefill is not timed). With `passes` > 1 the sweep repeats and each entry keeps the median over passes. The
    result is projected onto monotone costs (`CostModel.monotone`). `on_step(record)` sees every timed step's
    `StepRecord` (e.g. `AcceptanceTracker.observe`: real drafts on real responses). The engine must be idle and
    is left idle (the requests still running at the end are aborted), with its selector restored.
    """
    buckets, ks, room = _warmup_shapes(engine, prompts, buckets, ks, (steps, passes, block, max_tokens, settle, rows))
    feed = _Feed(engine, prompts, min(max_tokens, room), temperature)
    hook = engine.selector
    samples: dict[tuple[int, int], list[float]] = {}
    try:
        for _ in range(passes):
            for b in buckets:
                timed = [k for k in ks if not k.is_tree or b <= tree_max_batch]
                times = _time_bucket(engine, feed, b, timed, max(steps, -(-rows // b)), settle, block, on_step)
                engine.abort_all()
                # median per pass, then the median over passes: the table should describe the machine as
                # the rollout will see it (a min would pick each entry's luckiest moment, unevenly)
                for k in timed:
                    samples.setdefault((b, k), []).append(statistics.median(times[k]))
    finally:
        engine.configure(selector=hook)
        engine.abort_all()
    table = {key: statistics.median(v) for key, v in samples.items()}
    bad = [key for key, v in table.items() if not v > 0]
    if bad:
        raise RuntimeError(f"warm-up could not time (bucket, k) = {bad[:4]}")
    return CostModel(buckets, ks, extend_trees(table, buckets, ks)).monotone()


def extend_trees(table: dict, buckets: Sequence[int], ks: Sequence[Strategy]) -> dict:
    """Tree entries for the buckets the warm-up did not time, from the largest one it did: its time grown as the
    rows (a verify of many tokens per row is compute-bound at large batch), and never slower-growing than the
    longest chain column grows over the same buckets. Trees pay where the batch is small and the target forward
    has room to spare; above the timed buckets these entries only need to be no cheaper than the trees are, so
    the selector leaves them out (an entry it ever ran is corrected by its own steps)."""
    out = dict(table)
    chain = max((k for k in ks if not k.is_tree), key=lambda k: k.depth)
    for k in ks:
        timed = [b for b in buckets if (b, k) in table]
        if not k.is_tree or len(timed) == len(buckets):
            continue
        if not timed:
            raise ValueError(f"no timed bucket for {k.label}: time trees at the smallest bucket at least")
        b0 = timed[-1]
        for b in buckets:
            if (b, k) not in out:
                grow = max(b / b0, table[(b, chain)] / table[(b0, chain)])
                out[(b, k)] = table[(b0, k)] * grow
    return out


def _warmup_shapes(engine, prompts, buckets, ks, counts: tuple[int, ...]) -> tuple[list[int], list[int], int]:
    """(buckets, ks, tokens of room after the longest prompt) of a warm-up; an error for what cannot run.
    `counts`: measure's (steps, passes, block, max_tokens, settle, rows)."""
    if engine.has_unfinished():
        raise RuntimeError("cost model warm-up needs an idle engine (requests are still running)")
    if not prompts:
        raise ValueError("cost model warm-up needs at least one prompt")
    steps, passes, block, max_tokens, settle, rows = counts
    if steps < 1 or passes < 1 or block < 1 or max_tokens < 1 or settle < 0 or rows < 0:
        raise ValueError(f"need steps, passes, block, max_tokens >= 1 and settle, rows >= 0; got {steps}, {passes}, "
                         f"{block}, {max_tokens}, {settle}, {rows}")
    buckets = sorted(set(buckets or default_buckets(engine.max_batch)))
    ks = sorted({Strategy.of(k) for k in (ks if ks is not None else default_ks(engine.k_max))})
    if engine.drafter is None:
        ks = [Strategy.none()]
    if buckets[-1] > engine.max_batch:
        raise ValueError(f"bucket {buckets[-1]} exceeds the engine's max_batch {engine.max_batch}")
    deep = [k.label for k in ks if k.depth > engine.k_max]
    if deep:
        raise ValueError(f"strategies {deep} exceed the engine's k_max {engine.k_max}")
    for k in ks:
        engine.check_strategy(k)  # a tree the drafter cannot draft or the engine cannot hold: named here
    room = engine.max_seq_len - max(len(p) for p in prompts)
    if room < 2:
        raise ValueError(f"prompts too long for the warm-up (max_seq_len={engine.max_seq_len})")
    return buckets, ks, room


@dataclass
class _Feed:
    """The warm-up's requests: the prompts cycled, each admission with its own seed."""

    engine: object
    prompts: Sequence[Sequence[int]]
    max_tokens: int
    temperature: float
    admitted: int = 0

    def top_up(self, b: int) -> None:
        """Queue requests until `b` are running or waiting."""
        eng = self.engine
        while eng.slots.n + len(eng.waiting) < b:
            p = self.prompts[self.admitted % len(self.prompts)]
            eng.add_request(list(p), SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                                                   seed=self.admitted))
            self.admitted += 1


def _time_bucket(engine, feed: _Feed, b: int, ks: list[Strategy], n_steps: int, settle: int, block: int,
                 on_step) -> dict[Strategy, list[float]]:
    """Step seconds per k at batch b: the strategies take turns, `settle` untimed then `block` timed steps each,
    in rounds whose order reverses each time (at least two rounds): the batch starts fresh, so its rows grow
    longer and each step dearer as the rounds go on, and a k always timed after the others would be timed dearer
    than it is."""
    times: dict[int, list[float]] = {k: [] for k in ks}
    block = max(1, min(block, -(-n_steps // 2)))
    rounds = 0
    while any(len(t) < n_steps for t in times.values()):
        rounds += 1
        for k in (ks if rounds % 2 else ks[::-1]):
            engine.configure(selector=fixed_selector(k))
            settled, tries = 0, 0
            while len(times[k]) < n_steps and tries < settle + block + 4:
                feed.top_up(b)
                engine.step()
                tries += 1
                last = engine.last
                if last.rows != b or last.strategy != k:
                    continue
                if settled < settle:
                    settled += 1
                    continue
                times[k].append(last.seconds)
                if on_step is not None:
                    on_step(last)
                if len(times[k]) % block == 0:
                    break
    return times
