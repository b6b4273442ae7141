"""Out-of-sample calibration: constants fitted on one recorded `tailspec demo` run predict runs recorded with other
settings (worker count, steps, seed, mode, verify rule).

`fit` takes from the fitted run only what a user of the projection would carry to another run: the decode level
(measured decode seconds against the replay at the engine's warm-up table), the seconds a worker spends outside
decode per request, the dispatch delay, the scheduler's counting lags, the RL update's seconds per response token,
the step's seconds outside rollout and update, the reclaim wait, the drafter's accepted tokens per k and how they
move over the run's steps (`step_quality`: a held-out run's step i meets the same first drafter and policy the
fitted run's step i did), and the lent seconds a session spends not training: validating, in proportion to the
seconds trained, and starting, merging and stopping, per lend. `predict` replays a held-out run from its own inputs
only: its configuration, its warm-up cost tables (timed before its first step) and the response lengths its policy
wrote (the workload, as a trace is to the cluster projection). Nothing a held-out run measured during its steps
enters its prediction. A run without a drafter times no warm-up table; it takes the fitted run's mean table at the
CPU share of a core its workers had (run.json's placement: a simulated GPU's decode time goes as 1 / its share).

The decode level is a correction of speculative steps (the replay's chains-only selector at mean per-k
acceptance, the selector's exploration, trees the replay does not run): a run that speculates fits it, and it
applies to runs that speculate. A run decoding plainly is predicted at its table's own level (1): a speculating
fit run says nothing of plain steps, and the other way round.

Four figures are compared per held-out run: the mean step time, the mean rollout time, the idle GPU-seconds
the scheduler counted, and (co-trained runs) the training share: GPU-seconds of whole drafter optimizer steps ÷
idle GPU-seconds (`tailspec.demo.report.session_split`, the demo's and `bench e2e`'s `training_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tailspec.rollout.cost_model import CostModel
from tailspec.simulate import hardware as hw
from tailspec.simulate.calibrate import (
    counting_window,
    engine_context,
    lengths_array,
    load_run,
    measured_acceptance,
    replay_step,
    scaled_cost,
)
from tailspec.simulate.drafter import FixedAcceptance
from tailspec.simulate.lending import Latencies
from tailspec.simulate.step import StepInputs, StepOut

FIGURES = ("step_s", "rollout_s", "idle_gpu_s", "training_share")


@dataclass(frozen=True)
class Fitted:
    """Constants of one recorded run, each a whole-run ratio or mean (see the module docstring)."""

    run_dir: str
    level: float  # measured decode seconds ÷ the replay's at the warm-up tables (context term included)
    speculates: bool  # the fitted run decoded with a drafter: `level` applies to runs that do
    fixed_per_request: float  # a worker's seconds outside decode per request, in units of its warm-up t(1, 0)
    dispatch_s: float  # phase start → the workers start, and the last finish → the phase end
    phase_lag_s: float  # the last result → the trainer's phase change
    drain_lead_s: float  # a worker's drain report → its result
    train_s_per_token: float  # the RL update (less the reclaim wait) per response token
    other_s: float  # a step's seconds outside its rollout and its update
    stop_s: float  # the reclaim wait of a step that lent
    acceptance: list[float] | None  # E[tokens per row per step | k], k = 0..k_max
    quality: list[float]  # per step of the fitted run: its drafts' acceptance over the whole run's (`step_quality`)
    idle_per_lend_s: float  # lent GPU-seconds neither in optimizer steps nor validating, per lend (start-up, merge, stop)
    validate_per_train: float  # validating seconds per training second (a candidate every propose_min_steps steps)
    warmup: dict  # the fitted run's workers' mean warm-up table (CostModel.to_dict), for a run that timed none
    core_share: float  # the share of a core each of its simulated GPUs had


def core_share(record: dict) -> float:
    """The mean share of a core a simulated GPU had: its CPU quota, else its core split among the GPUs on it."""
    pl = record.get("placement") or {}
    if pl.get("quota"):
        return float(np.mean(pl["quota"]))
    cpus = [tuple(c) for c in pl.get("cpus", [])]
    if not cpus:
        return 1.0
    return float(np.mean([len(c) / cpus.count(c) for c in cpus]))


def mean_table(costs: list[CostModel]) -> CostModel:
    """The entry-wise mean of tables over the same buckets and strategies."""
    c0 = costs[0]
    return CostModel(list(c0.buckets), list(c0.ks), {key: float(np.mean([c.table[key] for c in costs]))
                                                     for key in c0.table})


def _workers(record: dict, rows: list[dict], fitted: Fitted | None = None) -> tuple[list[str], list[CostModel]]:
    """The run's workers and warm-up tables; without tables, the fitted run's at this run's core share."""
    if record.get("cost_models"):
        workers = sorted(record["cost_models"])
        return workers, [CostModel.from_dict(record["cost_models"][w]) for w in workers]
    if fitted is None:
        raise ValueError("the run has no warm-up cost tables to fit on")
    workers = sorted(rows[0]["worker_lengths"])
    table = scaled_cost(CostModel.from_dict(fitted.warmup), fitted.core_share / core_share(record))
    return workers, [table] * len(workers)


def _requests(r: dict, workers: list[str]) -> np.ndarray:
    return np.array([len(r["worker_lengths"].get(w, [])) for w in workers], dtype=float)


def _t10(warmup: list[CostModel]) -> np.ndarray:
    return np.array([c.t(1, 0) for c in warmup])


def _latencies(sc: dict, stop_s: float, phase_s: float, lead_s: float) -> Latencies:
    return Latencies(see_s=sc["tick_s"] / 2, telemetry_s=sc["sample_period_s"] / 2, window_s=sc["idle_window_s"],
                     tick_s=sc["tick_s"], startup_s=sc["session_startup_s"],
                     on_release=sc.get("lend_on_release", False), stop_s=stop_s,
                     phase_s=sc["tick_s"] / 2 + phase_s, lead_s=lead_s)


def _mean(xs: list[float], default: float = 0.0) -> float:
    return float(np.mean(xs)) if xs else default


def fit(run_dir: str | Path, model: hw.ModelSpec | None = None) -> Fitted:
    """The constants of the recorded run `run_dir` (the policy `model` prices the context term, as in
    `calibrate.calibrate`)."""
    record, rows = load_run(run_dir)
    cfg, mode = record["config"], record["options"].get("mode", "cotrained")
    workers, warmup = _workers(record, rows)
    sc = cfg["scheduler"]
    fixed = [[r["worker_busy_s"][w] - r["worker_decode_s"][w] for w in workers] for r in rows]
    n_req = [_requests(r, workers) for r in rows]
    fixed_per_request = float(np.sum(fixed) / np.sum([n * _t10(warmup) for n in n_req]))
    dispatch = _mean([r["rollout_time_s"] - max(r["worker_busy_s"].values()) for r in rows]) / 2
    lags = [counting_window(r, sc["tick_s"]) for r in rows]
    phase_lag, lead = _mean([p - sc["tick_s"] / 2 for p, _ in lags]), _mean([d for _, d in lags])
    lent_rows = [r for r in rows if r["lent_gpu_seconds"] > 0]
    stop_s = _mean([r["wait_sessions_s"] for r in lent_rows], 0.1)
    tokens = sum(r["tokens"] for r in rows)
    train_per_token = sum(r["train_time_s"] - r["wait_sessions_s"] for r in rows) / max(tokens, 1)
    other = _mean([r["step_time_s"] - r["rollout_time_s"] - r["train_time_s"] for r in rows])
    acceptance = measured_acceptance(rows, cfg["rollout"]["k_max"]) if mode != "nospec" else None
    quality = step_quality(rows, acceptance.tokens if acceptance else None)
    lends = sum(r.get("sessions", 0) for r in rows)
    trained = sum((r.get("session_seconds") or {}).get("train", 0.0) for r in rows)
    lent = sum(r["lent_gpu_seconds"] for r in rows)
    validating = sum((r.get("session_seconds") or {}).get("validate", 0.0) for r in rows)
    idle_per_lend = max(0.0, lent - trained - validating) / lends if lends else 0.0
    validate_per_train = validating / trained if trained > 0 else 0.0
    # the level: the measured decode seconds over the replay's at the warm-up tables, this run's own inputs
    ctx = engine_context(record, rows, workers, warmup, model)
    measured = projected = 0.0
    for r, f, q in zip(rows, fixed, quality):
        arr = lengths_array(r, workers)
        inp = StepInputs(arr, min(cfg["rollout"]["max_batch"], arr.shape[1]), warmup, _at_quality(acceptance, q),
                         np.array(f), 0.0, 1,
                         _latencies(sc, stop_s, phase_lag, lead), lend=False, drafter_tokens_per_s=0.0,
                         dispatch_s=dispatch)
        out = replay_step(inp, ctx)
        projected += float((out.finish - inp.fixed_s - dispatch).sum())
        measured += sum(r["worker_decode_s"][w] for w in workers)
    return Fitted(str(run_dir), measured / projected if projected else 1.0, mode != "nospec", fixed_per_request, dispatch, phase_lag,
                  lead, train_per_token, other, stop_s, acceptance.tokens if acceptance else None, quality, idle_per_lend,
                  validate_per_train,
                  mean_table(warmup).to_dict(), core_share(record))


def step_quality(rows: list[dict], tokens: list[float] | None) -> list[float]:
    """Per step: the drafts its chains accepted over what the whole run's per-k means (`tokens`) give for the same
    steps at the same k, so 1 is a step like the run's mean whatever its strategy mix. The drafter's acceptance
    moves over a run (a fresh drafter on the first policy accepts most; the policy then drifts from it), and a
    held-out run's step i meets the fitted run's step i's drafter and drift (the same first drafter and policy)."""
    out = []
    for r in rows:
        got = want = 0.0
        for k, (n, a) in (r.get("accepted_by_k") or {}).items():
            if k.isdigit() and 0 < int(k) < len(tokens or []) and n:
                got += a
                want += n * (tokens[int(k)] - 1)
        out.append(got / want if want > 0 else 1.0)
    return out


def _at_quality(a: FixedAcceptance | None, q: float) -> FixedAcceptance | None:
    """Acceptance `a` with its accepted drafts scaled by q (at most k per step)."""
    if a is None:
        return None
    return FixedAcceptance([1.0] + [min(k + 1.0, 1 + (t - 1) * q) for k, t in enumerate(a.tokens[1:], start=1)])


def _acceptance(a: FixedAcceptance | list[float] | None) -> FixedAcceptance | None:
    if a is None or isinstance(a, FixedAcceptance):
        return a
    return FixedAcceptance(list(a))


@dataclass
class Holdout:
    run_dir: str
    mode: str
    workers: int
    steps: int
    measured: dict[str, float]
    predicted: dict[str, float]
    rel_error: dict[str, float]

    @property
    def max_rel_error(self) -> float:
        return max(self.rel_error.values())

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "mode": self.mode, "workers": self.workers, "steps": self.steps,
                "measured": self.measured, "predicted": self.predicted, "rel_error": self.rel_error,
                "max_rel_error": self.max_rel_error}


def _trained(out: StepOut, fitted: Fitted) -> float:
    """GPU-seconds of whole optimizer steps: each lend's lent interval less what a lend spends starting, merging and
    stopping; the rest splits between training and validating candidates in proportion (a session proposes a
    candidate once the lineage holds `trainer.propose_min_steps` more optimizer steps, so validations follow the
    steps trained, not the lends)."""
    lent = out.lending.revoked - out.lending.lent
    return float(np.nansum(np.clip(lent - fitted.idle_per_lend_s, 0.0, None))) / (1 + fitted.validate_per_train)


def predict(run_dir: str | Path, fitted: Fitted, model: hw.ModelSpec | None = None) -> Holdout:
    """Replay the held-out run `run_dir` from its own configuration, warm-up tables and response lengths, with
    every other constant from `fitted`; compare the four figures with what it measured."""
    record, rows = load_run(run_dir, need_costs=False)
    cfg, mode = record["config"], record["options"].get("mode", "cotrained")
    workers, warmup = _workers(record, rows, fitted)
    sc, rc = cfg["scheduler"], cfg["rollout"]
    level = fitted.level if (mode != "nospec") == fitted.speculates else 1.0
    costs = [scaled_cost(c, level) for c in warmup]
    acceptance = _acceptance(fitted.acceptance) if mode != "nospec" else None
    if acceptance is not None and acceptance.k_max > rc["k_max"]:
        acceptance = FixedAcceptance(acceptance.tokens[: rc["k_max"] + 1])
    lat = _latencies(sc, fitted.stop_s, fitted.phase_lag_s, fitted.drain_lead_s)
    ctx = engine_context(record, rows, workers, warmup, model)
    pred = {"step_s": [], "rollout_s": [], "idle": 0.0, "trained": 0.0}
    for i, r in enumerate(rows):
        arr = lengths_array(r, workers)
        fixed = fitted.fixed_per_request * _requests(r, workers) * _t10(warmup)
        q = fitted.quality[min(i, len(fitted.quality) - 1)] if fitted.quality else 1.0
        train_s = fitted.train_s_per_token * float(arr.sum())
        inp = StepInputs(arr, min(rc["max_batch"], arr.shape[1]), costs, _at_quality(acceptance, q), fixed, train_s, 1,
                         replace(lat), lend=mode == "cotrained", drafter_tokens_per_s=0.0,
                         dispatch_s=fitted.dispatch_s)
        out = replay_step(inp, ctx)
        pred["step_s"].append(out.step_s + fitted.other_s)
        pred["rollout_s"].append(out.rollout_s)
        pred["idle"] += out.idle_gpu_s
        pred["trained"] += _trained(out, fitted)
    idle = sum(r["idle_gpu_seconds"] for r in rows)
    measured = {"step_s": _mean([r["step_time_s"] for r in rows]), "rollout_s": _mean([r["rollout_time_s"] for r in rows]),
                "idle_gpu_s": idle}
    predicted = {"step_s": _mean(pred["step_s"]), "rollout_s": _mean(pred["rollout_s"]), "idle_gpu_s": pred["idle"]}
    if mode == "cotrained" and any("session_seconds" in r for r in rows):
        trained = sum((r.get("session_seconds") or {}).get("train", 0.0) for r in rows)
        measured["training_share"] = trained / idle if idle else 0.0
        predicted["training_share"] = pred["trained"] / pred["idle"] if pred["idle"] else 0.0
    rel = {k: abs(predicted[k] - v) / v if v else (0.0 if predicted[k] == 0 else float("inf"))
           for k, v in measured.items()}
    return Holdout(str(run_dir), mode, len(workers), len(rows), measured, predicted, rel)


def out_of_sample(fit_dir: str | Path, held_out: list[str | Path], model: hw.ModelSpec | None = None) -> dict:
    """Fit on `fit_dir`, predict each of `held_out`; the largest relative error over runs and figures."""
    fitted = fit(fit_dir, model)
    runs = [predict(d, fitted, model) for d in held_out]
    per_figure = {f: max((h.rel_error[f] for h in runs if f in h.rel_error), default=0.0) for f in FIGURES}
    return {"label": "projection vs measured, held out", "fit_run": str(fit_dir),
            "fitted": {k: v for k, v in fitted.__dict__.items() if k not in ("run_dir", "acceptance", "warmup")},
            "runs": [h.to_dict() for h in runs], "max_rel_error_by_figure": per_figure,
            "max_rel_error": max(per_figure.values(), default=0.0)}
