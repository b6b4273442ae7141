"""The drafter's acceptance in a projection: how staleness lowers it and training on lent GPUs restores it.

Acceptance is a per-token rate alpha (draft j is accepted with probability alpha given drafts 0..j-1 were),
so E[tokens per row per step | k] = (1 - alpha^(k+1)) / (1 - alpha), the selector's own
`geometric_tokens`. A drafter's alpha is

    alpha = (alpha_max - (alpha_max - alpha0) * exp(-trained / saturate_tokens)) * (1 - decay) ** staleness

`staleness` counts policy steps the drafter has not seen: every RL step adds one; drafter training on
`refresh_tokens` tokens of fresh samples removes one. `trained` is the tokens it was trained on in total,
which moves alpha from the offline drafter's alpha0 toward alpha_max, what a drafter trained on the
policy's own outputs reaches. A frozen drafter keeps trained = 0 and grows stale by one a step. More
training never lowers alpha: both factors rise with it.

Defaults and where they come from (override them with measured figures: `bench cotrain`, the demo's
metrics.jsonl):
- alpha0 = 0.68: NeMo-RL's acceptance length 2.47 at k = 3 with an EAGLE-3 drafter on Qwen3-8B RL-Zero
  (arXiv 2604.26779); 1 + a + a^2 + a^3 = 2.47 gives a = 0.68.
- decay = 0.003 per step: a frozen drafter kept acceptance 2.56 -> 2.53 over 36 RL steps in one report
  (-1.2%, ~0.1% of alpha a step) while ReSpec reports drafters going stale as the actor updates; 0.3% a step
  sits between, an assumption to replace with a measured one.
- alpha_max = 0.78 and saturate_tokens = 5e7, refresh_tokens = 2e6: assumptions (a drafter distilled on the
  policy's own current outputs; tens of millions of tokens to adapt, a few million to follow one step).

drift.py fits a frozen drafter's decay and a co-trained drafter's recovery on recorded demo runs (`tailspec
simulate --drift`) and projects the gap they give as an interval; these defaults are not taken from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tailspec.rollout.selector import geometric_tokens


# The default curve's constants, as the hardware model's (`hardware.CONSTANTS`): the sweep's co-trained ÷ frozen gap
# comes from alpha_max and decay, which no recorded run measured; the drift fit (drift.py) is what the runs support.
CONSTANTS: dict[str, tuple[str, str]] = {
    "drafter.alpha0": ("assumed", "NeMo-RL's EAGLE-3 acceptance 2.47 at k = 3 on Qwen3-8B RL-Zero (published)"),
    "drafter.alpha_max": ("assumed", ("0.78: what a drafter distilled on the policy's own outputs reaches; the recorded "
                                      "runs show no co-trained drafter above its first acceptance")),
    "drafter.decay": ("assumed", ("0.3% of alpha a step; the recorded runs' fit (tailspec simulate --drift) gives the "
                                  "miniature's decay and the co-trained recovery, and the gap they project")),
    "drafter.saturate_and_refresh_tokens": ("assumed", "5e7 and 2e6 tokens"),
}


@dataclass(frozen=True)
class DrafterCurve:
    alpha0: float = 0.68
    alpha_max: float = 0.78
    decay: float = 0.003
    saturate_tokens: float = 5e7
    refresh_tokens: float = 2e6

    def __post_init__(self) -> None:
        if not (0 <= self.alpha0 < 1 and 0 <= self.alpha_max < 1 and 0 <= self.decay < 1):
            raise ValueError(f"need alpha0, alpha_max, decay in [0, 1), got {self.alpha0}, {self.alpha_max}, {self.decay}")
        if self.alpha_max < self.alpha0:
            raise ValueError(f"alpha_max ({self.alpha_max}) below alpha0 ({self.alpha0}): training would lower acceptance")
        if self.saturate_tokens <= 0 or self.refresh_tokens <= 0:
            raise ValueError("saturate_tokens and refresh_tokens must be > 0")

    def alpha(self, trained: float, staleness: float) -> float:
        base = self.alpha_max - (self.alpha_max - self.alpha0) * math.exp(-trained / self.saturate_tokens)
        return base * (1 - self.decay) ** staleness


@dataclass
class DrafterState:
    """One drafter lineage during a projection (frozen: never trained)."""

    curve: DrafterCurve
    trained: float = 0.0
    staleness: float = 0.0
    history: list[float] = field(default_factory=list)  # alpha used by each step

    @property
    def alpha(self) -> float:
        return self.curve.alpha(self.trained, self.staleness)

    def policy_step(self) -> None:
        self.staleness += 1

    def train(self, tokens: float) -> None:
        if tokens < 0:
            raise ValueError(f"trained tokens must be >= 0, got {tokens}")
        self.trained += tokens
        self.staleness = max(0.0, self.staleness - tokens / self.curve.refresh_tokens)


@dataclass
class FixedAcceptance:
    """What the adaptive selector reads from an acceptance tracker, at fixed per-k expected tokens."""

    tokens: list[float]  # E[tokens per row per step | k], k = 0..k_max
    settle_steps: int = 3
    k_weight: float = 16.0
    k_rows: dict[int, float] = field(default_factory=dict)

    @property
    def k_max(self) -> int:
        return len(self.tokens) - 1

    def token_table(self) -> list[float]:
        return self.tokens

    def update(self, *args, **kwargs) -> None:  # the selector's flush: nothing to learn, the rates are given
        return None

    @classmethod
    def geometric(cls, alpha: float, k_max: int) -> FixedAcceptance:
        return cls([geometric_tokens(alpha, k) for k in range(k_max + 1)])
