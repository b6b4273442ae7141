"""The drafter health guard: after every drafter load or reload and every policy-weight sync, the live
acceptance over the next steps is compared with what the drafter was validated at; a drafter that is broken
(acceptance near 1 token per forward, or far below its validated gain) turns speculation off until another
version loads.

Why: the failure RL users hit most with speculative rollouts is a drafter silently broken by a weight sync or a
sleep/wake cycle (wrong or zeroed weights, a stale vocabulary map). Sampling stays exact — rejection sampling
guarantees that — so nothing fails; rollouts just run slower than without speculation, for hours. The guard
turns that into an alert and a fallback within one window of steps.

The guard only counts: `observe(strategy, rows, accepted)` after each decode step (plain decoding is not
evidence), `arm(...)` at each load or sync event. It never touches an engine; `guarded` wraps an engine's selector
so that it feeds the guard every step's record and runs k = 0 while the guard is tripped.

An adaptive engine runs whatever strategy pays at its batch size, so live and validated are compared at the
window's own mix of strategies, never a k = 1 step against a k = 4 figure. A version validated under the
rollouts' strategy mix carries its validated rate per (depth, sibling rank) (`DrafterVersion.rank_rates`): a
step's expected accepted drafts per row are then `expected_accepted(step's strategy, that table)`, trees
included, the same valuation validation scored it by. A version validated at one draft length only (its
acceptance length at `validated_k`) has the guard fit the per-position acceptance α of a chain drafter
(α + α² + … + α^K = validated − 1) and expect Σ_{j ≤ depth} α^j accepted drafts per row at a step of that depth."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tailspec.core import state
from tailspec.rollout.strategy import Selector, StepRecord, Strategy, expected_accepted


@dataclass(frozen=True)
class GuardPolicy:
    window_steps: int = 16  # decode steps with k > 0 that make up one verdict
    floor: float = 1.05  # tokens per forward at or below which the drafter is broken, whatever it validated at
    min_gain_share: float = 0.5  # live gain (length - 1) below this share of the validated gain: broken

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError(f"guard window_steps must be >= 1, got {self.window_steps}")
        if self.floor < 1.0:
            raise ValueError(f"guard floor is a tokens-per-forward figure (>= 1.0), got {self.floor}")
        if not 0.0 <= self.min_gain_share <= 1.0:
            raise ValueError(f"guard min_gain_share must be in [0, 1], got {self.min_gain_share}")


@dataclass(frozen=True)
class Verdict:
    tripped: bool
    version: int | None  # the drafter version judged
    event: str  # what armed the guard: "load", "reload", "policy_sync", ...
    live: float  # tokens per forward over the window
    validated: float | None  # tokens per forward the validation predicts at the window's k mix, if known
    steps: int
    reason: str

    def message(self) -> str:
        v = f"drafter v{self.version}" if self.version is not None else "drafter"
        if not self.tripped:
            return f"{v} healthy after {self.event}: {self.live:.2f} tokens/forward over {self.steps} steps"
        return (f"{v} broken after {self.event}: {self.reason}; speculation off until another version loads")


class HealthGuard:
    """One per engine. States: idle (not armed), watching (counting a window), judged (until the next arm).
    A tripped guard keeps `speculate` False until `arm` is called for a different version."""

    def __init__(self, policy: GuardPolicy | None = None):
        self.policy = policy or GuardPolicy()
        self.version: int | None = None
        self.validated: float | None = None
        self.validated_k = 4
        self._alpha: float | None = None
        self._table: Callable[[int, int], float] | None = None  # accept(d, r) from the validated rank table
        self._by_strategy: dict[Strategy, float] = {}  # expected accepted drafts per row, under the table
        self.event = ""
        self.watching = False
        self.tripped_version: int | None = None
        self._tripped = False
        self._steps = self._rows = self._accepted = 0
        self._expected = 0.0
        self.verdicts: list[Verdict] = []

    @property
    def speculate(self) -> bool:
        return not self._tripped

    def arm(self, version: int | None, validated: float | None, event: str, validated_k: int = 4,
            rank_rates: Sequence[Sequence[float]] | None = None) -> None:
        """A drafter was loaded or reloaded, or the policy weights changed under it: watch the next window.
        `validated`: the version's acceptance length at draft length `validated_k` (None: unknown, only the
        floor applies). `rank_rates`: its validated rate per [depth][sibling rank], when it was scored under the
        rollouts' strategy mix; steps are then judged by it (the module doc). A new version clears a trip; the
        same version after a policy sync keeps speculation off only if it was already judged broken (a sync
        does not repair a drafter)."""
        if validated_k < 1:
            raise ValueError(f"validated_k must be >= 1, got {validated_k}")
        if version != self.tripped_version:
            self._tripped = False
        self.version, self.validated, self.validated_k, self.event = version, validated, validated_k, event
        self._table = table_accept(rank_rates) if rank_rates else None
        self._by_strategy = {}
        self._alpha = chain_alpha(validated, validated_k) if validated is not None else None
        self.watching = not self._tripped
        self._steps = self._rows = self._accepted = 0
        self._expected = 0.0

    def observe(self, strategy: Strategy | int, rows: int, accepted: int) -> Verdict | None:
        """Fold one decode step (`strategy`, or a chain's k, run for `rows` rows, `accepted` drafts accepted in
        all); the verdict when this step completes a window, else None."""
        s = Strategy.of(strategy)
        k = s.depth
        if not self.watching or k <= 0 or rows <= 0:
            return None
        if accepted < 0 or accepted > k * rows:
            raise ValueError(f"accepted {accepted} outside 0..k*rows = 0..{k * rows}")
        self._steps += 1
        self._rows += rows
        self._accepted += accepted
        if self._table is not None:
            if s not in self._by_strategy:
                self._by_strategy[s] = expected_accepted(s, self._table)
            self._expected += rows * self._by_strategy[s]
        elif self._alpha is not None:
            a = self._alpha
            self._expected += rows * (a * (1 - a**k) / (1 - a) if a < 1 else float(k))
        if self._steps < self.policy.window_steps:
            return None
        return self._judge()

    def observe_totals(self, k: float, drafts: int, accepted: int) -> Verdict | None:
        """Fold a whole generation call's counters, where an engine's steps are out of reach (a framework's
        engine in its own process: only its cumulative counters are read, before and after a batch). `k`:
        drafted tokens per draft (vLLM's `mean_k`); each draft counts as one step of the window, since a step
        drafts for at least one row. The verdict when the window is complete, else None."""
        if not self.watching or k <= 0 or drafts <= 0:
            return None
        if accepted < 0 or accepted > k * drafts + 1e-9:
            raise ValueError(f"accepted {accepted} outside 0..k*drafts = 0..{k * drafts:g}")
        self._steps += drafts
        self._rows += drafts
        self._accepted += accepted
        if self._table is not None:  # k may be a mean over the call's draft lengths: between its two chains
            lo = math.floor(k)
            at = [expected_accepted(Strategy.chain(j), self._table) for j in (lo, lo + 1)]
            self._expected += drafts * (at[0] + (k - lo) * (at[1] - at[0]))
        elif self._alpha is not None:
            a = self._alpha  # k may be a mean over the call's draft lengths: the sum's closed form takes it
            self._expected += drafts * (a * (1 - a**k) / (1 - a) if a < 1 else k)
        if self._steps < self.policy.window_steps:
            return None
        return self._judge()

    def _judge(self) -> Verdict:
        p = self.policy
        live = 1.0 + self._accepted / self._rows
        expected = 1.0 + self._expected / self._rows if self._alpha is not None or self._table is not None else None
        reason = ""
        if live <= p.floor:
            reason = f"{live:.3f} tokens/forward <= floor {p.floor}"
        elif expected is not None and expected > 1.0 and live - 1.0 < p.min_gain_share * (expected - 1.0):
            reason = (f"{live:.3f} tokens/forward, gain {live - 1:.3f} < {p.min_gain_share:.0%} of the validated "
                      f"gain {expected - 1:.3f} at these draft lengths")
        v = Verdict(bool(reason), self.version, self.event, live, expected, self._steps, reason)
        self.watching = False
        if v.tripped:
            self._tripped, self.tripped_version = True, self.version
        self.verdicts.append(v)
        return v


def table_accept(rank_rates: Sequence[Sequence[float]]) -> Callable[[int, int], float]:
    """accept(d, r) of `expected_accepted` from a validated rate table [depth][sibling rank]: a depth past the
    table takes its deepest row (the engine may run deeper than the mix validation saw), a rank past it 0 (a
    sibling never scored earns no credit)."""
    table = [list(row) for row in rank_rates]

    def accept(d: int, r: int) -> float:
        row = table[min(d, len(table) - 1)]
        return float(row[r]) if r < len(row) else 0.0

    return accept


def validated_alpha(acceptance_length: float, k: int, rank_rates: Sequence[Sequence[float]] | None = None) -> float:
    """The per-position acceptance α of a chain drafter that stands for a validated version (an acceptance
    tracker's prior): the chain fit of its acceptance length at draft length k, or, when it carries a rank table
    (scored under a strategy mix, so its acceptance length is the mix's, trees included), of the table's chain
    of k."""
    if rank_rates:
        return chain_alpha(1.0 + expected_accepted(Strategy.chain(k), table_accept(rank_rates)), k)
    return chain_alpha(acceptance_length, k)


def chain_alpha(acceptance_length: float, k: int) -> float:
    """The per-position acceptance α of a chain drafter whose expected acceptance length at draft length k is
    `acceptance_length` (1 + α + … + α^k); clipped to [0, 1]."""
    gain = min(max(acceptance_length - 1.0, 0.0), float(k))
    lo, hi = 0.0, 1.0
    for _ in range(50):  # the sum is increasing in α: bisection to ~1e-15
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(1, k + 1)) < gain:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def guarded(selector: Selector, guard: HealthGuard,
            on_verdict: Callable[[Verdict], None] | None = None) -> Selector:
    """An engine selector that folds every step's record into `guard` and runs plain decoding (k = 0)
    while the guard holds speculation off; otherwise `selector` decides. The inner hook still sees every
    record, so its estimates stay current. `on_verdict` is called with each verdict as it is reached."""
    seen: list[StepRecord | None] = [None]

    def hook(batch_size: int, last: StepRecord | None) -> int:
        if last is not None and last is not seen[0]:
            seen[0] = last
            verdict = guard.observe(last.strategy, last.rows, last.accepted)
            if verdict is not None and on_verdict is not None:
                on_verdict(verdict)
        k = selector(batch_size, last)
        return k if guard.speculate else 0

    return hook


def record_verdict(redis, cluster: str, worker: str, verdict: Verdict, backend: str = "native") -> None:
    """Publish `worker`'s latest verdict (the web dashboard's guard banner reads these: a tripped worker decodes
    without speculation until a later verdict on another version says healthy) and count a trip."""
    status = state.GuardStatus(worker=worker, backend=backend, tripped=verdict.tripped, version=verdict.version,
                               event=verdict.event, live=verdict.live, validated=verdict.validated,
                               steps=verdict.steps, reason=verdict.reason)
    redis.hset(state.key(cluster, "drafter_guard"), worker, state.encode(status))
    if verdict.tripped:
        count_trip(redis, cluster)


def count_trip(redis, cluster: str) -> None:
    """Count a tripped guard in the cluster's counters (`tailspec_drafter_guard_trips_total` on /metrics, the
    Grafana dashboard's guard panel), beside the `drafter_guard` event the rollout side records for every
    verdict."""
    redis.hincrby(state.key(cluster, "counters"), "drafter_guard_trips", 1)
