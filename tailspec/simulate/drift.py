"""The drafter's drift with a source: a frozen drafter's acceptance decay and a co-trained drafter's recovery,
fitted on recorded `tailspec demo` runs, with the published shapes as priors; the co-trained vs frozen gap over
a user's run length projected as an interval.

What the recorded runs hold (metrics.jsonl): at every measured step the expected acceptance length at the
rollout's k of the first (frozen) drafter and of the version in use (co-trained), both on that step's samples,
and the policy's drift where the task records one: `alt_style_share`, the share of responses written in the
style the reward's bonus drives the policy to (tailspec/tasks/runsum.py), which the first drafter never saw. At
every step, in runs recorded since the demo measures them (tailspec/rl.py: policy_drift): `policy_entropy`, the
policy's mean token entropy on its own responses, and `policy_kl`, the k3 estimate of KL(last step's policy ||
this step's) on the last step's responses.

Fitted, each with its standard error, on per-token acceptance (`fit.alpha_for` at the run's k):
- `decay`: the frozen drafter's loss of log-alpha per RL step (log-linear in the step, pooled over runs);
- `drift_slope`: its loss of acceptance length, relative to the first step's, per unit of the policy's drift
  (linear in the drift measure: Bebop's shape, where acceptance falls linearly as the policy's entropy rises);
  `saturation`: the largest log-alpha loss the recorded runs reached, where their drift measure stopped growing;
- `recovery`: the share of the frozen drafter's log-alpha loss the co-trained drafter does not lose, over the
  measured steps of co-trained runs at which the frozen drafter had lost at least `MIN_LOSS`;
- the policy's own drift (`PolicyDrift`, runs with `policy_kl`): its KL a step and how that changes over a run
  (log-linear in the step), its entropy's change a step, and the frozen drafter's log-alpha loss per nat of the
  policy's cumulative KL since the first measured step (`loss_per_kl`) and its relative acceptance-length loss per
  nat of entropy change (`loss_per_entropy`: Bebop's shape).

Priors (RESEARCH.md, "Newer anchors" and "2026"):
- Marin: a frozen one-layer EAGLE-3 on GH200 kept acceptance 2.56 → 2.53 over 36 RL steps (k assumed 3): the
  slow end of the decay;
- Bebop (Qwen): MTP acceptance falls linearly as policy entropy rises: the drift-linear shape;
- NeMo-RL (arXiv 2604.26779): online adaptation took a domain-aligned EAGLE-3 from 1.77× to 1.78× and a generic
  one from 1.51× to 1.63× (RL-Zero, k = 3): recovery matters where the drafter starts far from the policy.

The projection's interval spans the decay's ends: the miniature's measured decay per step (saturating where its
drift did), Marin's (not saturating) and, where the runs recorded the policy's KL, the loss the policy's own
cumulative KL predicts (`loss_per_kl` x the KL a step, carried forward with its fitted trend, which is held at no
growth: a run's later steps move the policy no more than its early ones); each with the recovery at its fitted
value ± one standard error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tailspec.simulate.calibrate import read_run
from tailspec.simulate.drafter import DrafterCurve
from tailspec.simulate.fit import alpha_for
from tailspec.simulate.run import Scenario, simulate

MIN_LOSS = 0.02  # a co-trained point counts for the recovery where the frozen drafter lost this much log-alpha
MARIN = {"source": "Marin (GH200): frozen one-layer EAGLE-3, acceptance 2.56 -> 2.53 over 36 RL steps",
         "first": 2.56, "last": 2.53, "steps": 36, "k": 3}
BEBOP = "Bebop (Qwen): MTP acceptance falls linearly as policy entropy rises during RL"
NEMO_RL = "NeMo-RL (arXiv 2604.26779): online adaptation 1.77x -> 1.78x (domain-aligned), 1.51x -> 1.63x (generic)"


@dataclass(frozen=True)
class Estimate:
    value: float
    se: float
    n: int

    def to_dict(self) -> dict:
        return {"value": self.value, "se": self.se, "n": self.n}


@dataclass(frozen=True)
class Trajectory:
    """One recorded run's measured steps: (step, frozen, co-trained acceptance length, drift or None); and every
    step's (step, policy entropy, policy KL since the step before), None where not recorded."""

    run_dir: str
    mode: str
    k: int
    points: list[tuple[int, float, float | None, float | None]]
    policy: list[tuple[int, float | None, float | None]] = field(default_factory=list)

    def cum_kl(self, s0: int, s: int) -> float | None:
        """The policy's KL summed over the steps after s0 up to s (each step's KL since the one before); None
        when a step between them has none."""
        by_step = {st: kl for st, _, kl in self.policy}
        kls = [by_step.get(i) for i in range(s0 + 1, s + 1)]
        return None if any(k is None for k in kls) else float(sum(kls))

    def entropy(self, s: int) -> float | None:
        return next((e for st, e, _ in self.policy if st == s), None)


def read_trajectory(run_dir: str | Path) -> Trajectory:
    d = Path(run_dir)
    record, rows = read_run(d)
    k = int(record["options"].get("k") or record["config"]["rollout"]["k"])
    pts = [(r["step"], r["acceptance_frozen"], r.get("acceptance_cotrained"), r.get("alt_style_share"))
           for r in rows if r.get("acceptance_frozen")]
    policy = [(r["step"], r.get("policy_entropy"), r.get("policy_kl")) for r in rows]
    return Trajectory(str(d), record["options"].get("mode", "cotrained"), k, pts, policy)


def _through_origin(xs: list[float], ys: list[float]) -> Estimate:
    """The least-squares slope of y = b x, its standard error."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    sxx = float((x * x).sum())
    if len(x) < 2 or sxx == 0:
        return Estimate(0.0, math.inf, len(x))
    b = float((x * y).sum() / sxx)
    se = math.sqrt(float(((y - b * x) ** 2).sum()) / (len(x) - 1) / sxx)
    return Estimate(b, se, len(x))


def _mean(xs: list[float]) -> Estimate:
    if not xs:
        return Estimate(0.0, math.inf, 0)
    se = float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else math.inf
    return Estimate(float(np.mean(xs)), se, len(xs))


def _pooled_slope(groups: list[tuple[list[float], list[float]]]) -> Estimate:
    """The least-squares slope of y on x with an intercept per group (each run its own level), its standard error."""
    xs, ys = [], []
    for gx, gy in groups:
        if len(gx) >= 2:
            x, y = np.asarray(gx, float), np.asarray(gy, float)
            xs.append(x - x.mean())
            ys.append(y - y.mean())
    if not xs:
        return Estimate(0.0, math.inf, 0)
    x, y = np.concatenate(xs), np.concatenate(ys)
    sxx, dof = float((x * x).sum()), len(x) - len(xs) - 1
    if sxx == 0 or dof < 1:
        return Estimate(0.0, math.inf, len(x))
    b = float((x * y).sum() / sxx)
    return Estimate(b, math.sqrt(float(((y - b * x) ** 2).sum()) / dof / sxx), len(x))


@dataclass(frozen=True)
class PolicyDrift:
    """The policy's own drift, fitted on the recorded runs that measured it (their `policy_kl`, `policy_entropy`)."""

    kl_per_step: Estimate  # mean KL(policy a step before || policy), nats, over the recorded steps
    kl_trend: Estimate  # d log(KL a step) / d step, runs pooled with a level each
    kl_step1: float  # the KL of a run's first step on that fit (the runs' levels averaged in log)
    entropy_per_step: Estimate  # d entropy / d step, nats, runs pooled with a level each
    loss_per_kl: Estimate | None  # frozen: log-alpha lost per nat of the policy's cumulative KL
    loss_per_entropy: Estimate | None  # frozen: relative acceptance-length loss per nat of entropy change

    def cum_kl(self, steps: int) -> list[float]:
        """The cumulative KL after t = 0 … steps-1 steps: the fitted KL a step (`kl_step1` at the first, then with
        its trend), held at no growth (a positive fitted trend over a few steps is not extrapolated to hundreds:
        the recorded mean KL a step is carried instead)."""
        falling = math.isfinite(self.kl_trend.se) and self.kl_trend.value < 0
        out, total = [], 0.0
        for t in range(steps):
            out.append(total)
            total += self.kl_step1 * math.exp(self.kl_trend.value * t) if falling else self.kl_per_step.value
        return out

    def to_dict(self) -> dict:
        return {"kl_per_step": self.kl_per_step.to_dict(), "kl_trend": self.kl_trend.to_dict(),
                "kl_step1": self.kl_step1,
                "entropy_per_step": self.entropy_per_step.to_dict(),
                "loss_per_kl": self.loss_per_kl.to_dict() if self.loss_per_kl else None,
                "loss_per_entropy": self.loss_per_entropy.to_dict() if self.loss_per_entropy else None}


@dataclass(frozen=True)
class DriftFit:
    decay: Estimate  # frozen: log-alpha lost per RL step
    drift_slope: Estimate | None  # frozen: relative acceptance-length loss per unit of the drift measure
    saturation: float  # the largest log-alpha loss of a frozen drafter the recorded runs reached
    recovery: Estimate  # co-trained: share of the frozen log-alpha loss not lost
    runs: list[str]
    policy: PolicyDrift | None = None  # where runs recorded the policy's KL and entropy

    def to_dict(self) -> dict:
        return {"decay_per_step": self.decay.to_dict(),
                "drift_slope": self.drift_slope.to_dict() if self.drift_slope else None,
                "saturation": self.saturation, "recovery": self.recovery.to_dict(), "runs": self.runs,
                "policy": self.policy.to_dict() if self.policy else None,
                "priors": [MARIN["source"], BEBOP, NEMO_RL], "label": "fitted on recorded demo runs"}


def fit_policy_drift(trajs: list[Trajectory]) -> PolicyDrift | None:
    """The policy's KL and entropy a step, and the frozen drafter's loss against them; None when no run recorded
    the policy's KL."""
    kls, kl_groups, ent_groups, cum, log_loss, d_ent, rel_loss = [], [], [], [], [], [], []
    seen: set[tuple] = set()
    for t in trajs:
        per = [(s, kl) for s, _, kl in t.policy if kl is not None and kl > 0]
        if not per:
            continue
        key = tuple((s, round(kl, 6)) for s, kl in per)  # a bench's modes share a policy under the coupled rule
        if key in seen:
            continue
        seen.add(key)
        kls += [kl for _, kl in per]
        kl_groups.append(([float(s) for s, _ in per], [math.log(kl) for _, kl in per]))
        ents = [(s, e) for s, e, _ in t.policy if e is not None]
        ent_groups.append(([float(s) for s, _ in ents], [e for _, e in ents]))
        if len(t.points) < 2:
            continue
        s0, f0 = t.points[0][0], t.points[0][1]
        a0 = math.log(alpha_for(min(f0, t.k + 1), t.k))
        for s, f, _, _ in t.points[1:]:
            c, e, e0 = t.cum_kl(s0, s), t.entropy(s), t.entropy(s0)
            if c is not None:
                cum.append(c)
                log_loss.append(a0 - math.log(alpha_for(min(f, t.k + 1), t.k)))
            if e is not None and e0 is not None:
                d_ent.append(e - e0)
                rel_loss.append(1 - f / f0)
    if not kls:
        return None
    trend = _pooled_slope(kl_groups)
    b = trend.value if math.isfinite(trend.se) else 0.0
    level = float(np.mean([np.mean(gy) - b * np.mean(gx) for gx, gy in kl_groups]))  # log KL at step 0, per run
    return PolicyDrift(_mean(kls), trend, math.exp(level + b), _pooled_slope(ent_groups),
                       _through_origin(cum, log_loss) if cum else None,
                       _through_origin(d_ent, rel_loss) if d_ent else None)


def fit_drift(run_dirs: list[str | Path]) -> DriftFit:
    """Fit the frozen decay, its drift slope and the co-trained recovery on the recorded runs `run_dirs`."""
    trajs = [read_trajectory(d) for d in run_dirs]
    steps, log_loss, drift, rel_loss, recov, sat = [], [], [], [], [], 0.0
    seen: set[tuple] = set()  # a frozen trajectory counts once (a bench's modes share one under the coupled rule)
    for t in trajs:
        if len(t.points) < 2:
            continue
        s0, f0, _, d0 = t.points[0]
        a0 = math.log(alpha_for(min(f0, t.k + 1), t.k))
        frozen = tuple((s, round(f, 3)) for s, f, _, _ in t.points)  # equal to 3 decimals: the same one
        if frozen not in seen:
            seen.add(frozen)
            for s, f, _, d in t.points[1:]:
                lf = math.log(alpha_for(min(f, t.k + 1), t.k))
                steps.append(s - s0)
                log_loss.append(lf - a0)
                sat = max(sat, a0 - lf)
                if d is not None and d0 is not None:
                    drift.append(d - d0)
                    rel_loss.append(f / f0 - 1)
        if t.mode != "cotrained":
            continue
        for _, f, c, _ in t.points[1:]:  # every co-trained run counts: its co-trained drafter is its own
            lf = math.log(alpha_for(min(f, t.k + 1), t.k))
            if c is not None and a0 - lf >= MIN_LOSS:
                lc = math.log(alpha_for(min(c, t.k + 1), t.k))
                recov.append((lc - lf) / (a0 - lf))
    if not steps:
        raise ValueError("no recorded run measured its frozen drafter at two steps or more")
    slope = _through_origin(steps, log_loss)
    decay = Estimate(-slope.value, slope.se, slope.n)
    ds = _through_origin(drift, rel_loss) if drift else None
    drift_slope = Estimate(-ds.value, ds.se, ds.n) if ds else None
    return DriftFit(decay, drift_slope, sat, _mean(recov), [t.run_dir for t in trajs], fit_policy_drift(trajs))


def marin_decay() -> float:
    """Log-alpha lost per RL step by Marin's frozen drafter (k assumed 3)."""
    a, b = alpha_for(MARIN["first"], MARIN["k"]), alpha_for(MARIN["last"], MARIN["k"])
    return math.log(a / b) / MARIN["steps"]


def frozen_log_loss(step: int, decay: float, floor: float | None) -> float:
    """Log-alpha a frozen drafter has lost after `step` RL steps (at most `floor` where the loss saturates)."""
    loss = decay * step
    return min(loss, floor) if floor is not None else loss


def project_gap(steps: int, fitted: DriftFit, alpha0: float, step_time: Callable[[float], float]) -> dict:
    """The co-trained ÷ frozen speed over `steps` RL steps (frozen mean step time ÷ co-trained), an interval over
    the decay's two ends (the miniature's, saturating at its largest loss; Marin's, not saturating) and the
    recovery ± one standard error; `step_time(alpha)` is a step's seconds at per-token acceptance alpha."""
    if not 1 <= steps <= 100_000:
        raise ValueError(f"steps must be in 1..100000, got {steps}")
    rec = fitted.recovery
    rho = [min(1.0, max(0.0, rec.value + s * (rec.se if math.isfinite(rec.se) else 0.0))) for s in (-1, 1)]
    ends = {"miniature": [frozen_log_loss(t, fitted.decay.value, fitted.saturation) for t in range(steps)],
            "marin": [frozen_log_loss(t, marin_decay(), None) for t in range(steps)]}
    pol = fitted.policy
    if pol is not None and pol.loss_per_kl is not None and pol.loss_per_kl.value > 0:
        ends["policy_kl"] = [pol.loss_per_kl.value * c for c in pol.cum_kl(steps)]
    cases = []
    for name, losses in ends.items():
        for r in rho:
            fr = [alpha0 * math.exp(-x) for x in losses]
            co = [alpha0 * math.exp(-(1 - r) * x) for x in losses]
            gap = sum(map(step_time, fr)) / sum(map(step_time, co))
            cases.append({"decay_end": name, "recovery": r, "gap": gap, "frozen_alpha_last": fr[-1],
                          "cotrained_alpha_last": co[-1]})
    gaps = [c["gap"] for c in cases]
    return {"steps": steps, "gap_interval": [min(gaps), max(gaps)], "cases": cases, "label": "projection"}


def step_time_curve(times: dict[float, float]) -> Callable[[float], float]:
    """A step's seconds at any alpha, linear between the projected points `times` {alpha: seconds}."""
    xs = sorted(times)
    ys = [times[x] for x in xs]
    return lambda a: float(np.interp(a, xs, ys))


def scenario_step_time(sc: Scenario, alphas: tuple[float, ...] = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9)) -> Callable[[float], float]:
    """`step_time(alpha)` for `project_gap`: the frozen drafter's mean projected step seconds of the Scenario `sc`
    (2 steps each) at each of `alphas`, per-token acceptance held there, linear between them."""
    times = {}
    for a in alphas:
        proj = simulate(replace(sc, steps=2, curve=DrafterCurve(alpha0=a, alpha_max=a, decay=0.0)))
        times[a] = float(np.mean([r.step_s for r in proj.mode_rows("frozen")]))
    return step_time_curve(times)
