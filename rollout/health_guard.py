"""The drafter health guard: after every drafter load or reload and every policy-weight sync, the live
acceptance over the next steps is compared with what the drafter was validated at; a drafter that is broken
(acceptance near 1 token per forward, or far below its validated gain) turns speculation off until another
version loads.

Why: the failure RL users hit most with speculative rollouts is a drafter silently broken by a weight sync or a
sleep/wake cycle (wrong or zeroed weights, a stale vocabulary map). Sampling stays exact — rejection sampling
guarantees that — so nothing fails; rollouts just run slower than without speculation, for hours. The guard
turns that into an alert and a fallback within one window of steps.

The guard only counts: `observe(k, rows, accepted)` after each decode step (k = 0 steps are not evidence),
`arm(...)` at each load or sync event. It never touches an engine; the caller asks `speculate` before
choosing k. Live acceptance length = 1 + accepted drafts per row-step, the same tokens-per-forward figure a
validation reports, so the two compare directly."""

from __future__ import annotations

from dataclasses import dataclass


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
    validated: float | None  # the version's validated acceptance length, if known
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
        self.event = ""
        self.watching = False
        self.tripped_version: int | None = None
        self._tripped = False
        self._steps = self._rows = self._accepted = 0
        self.verdicts: list[Verdict] = []

    @property
    def speculate(self) -> bool:
        return not self._tripped

    def arm(self, version: int | None, validated: float | None, event: str) -> None:
        """A drafter was loaded or reloaded, or the policy weights changed under it: watch the next window.
        A new version clears a trip; the same version after a policy sync keeps speculation off only if it
        was already judged broken (a sync does not repair a drafter)."""
        if version != self.tripped_version:
            self._tripped = False
        self.version, self.validated, self.event = version, validated, event
        self.watching = not self._tripped
        self._steps = self._rows = self._accepted = 0

    def observe(self, k: int, rows: int, accepted: int) -> Verdict | None:
        """Fold one decode step (k drafts for each of `rows` rows, `accepted` drafts accepted in all); the
        verdict when this step completes a window, else None."""
        if not self.watching or k <= 0 or rows <= 0:
            return None
        if accepted < 0 or accepted > k * rows:
            raise ValueError(f"accepted {accepted} outside 0..k*rows = 0..{k * rows}")
        self._steps += 1
        self._rows += rows
        self._accepted += accepted
        if self._steps < self.policy.window_steps:
            return None
        return self._judge()

    def _judge(self) -> Verdict:
        p = self.policy
        live = 1.0 + self._accepted / self._rows
        reason = ""
        if live <= p.floor:
            reason = f"{live:.3f} tokens/forward <= floor {p.floor}"
        elif self.validated is not None and self.validated > 1.0 and \
                live - 1.0 < p.min_gain_share * (self.validated - 1.0):
            reason = (f"{live:.3f} tokens/forward, gain {live - 1:.3f} < {p.min_gain_share:.0%} of the validated "
                      f"gain {self.validated - 1:.3f}")
        v = Verdict(bool(reason), self.version, self.event, live, self.validated, self._steps, reason)
        self.watching = False
        if v.tripped:
            self._tripped, self.tripped_version = True, self.version
        self.verdicts.append(v)
        return v
