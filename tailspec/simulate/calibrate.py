"""Calibration: replay a recorded `tailspec demo` run through the projection and compare.

The projection is fed what the run measured *as costs*, never its outcomes: each worker's cost table t(b, k)
as its engine knew it before the step (run.json's warm-up table, corrected by the steps before), the response lengths each worker decoded (metrics.jsonl), the drafts accepted per
k over the whole run, each worker's mean seconds outside decode steps (set-up, admissions), the RL update's
mean time and the scheduler's configured delays. It predicts each step's rollout time, the idle GPU-seconds
the scheduler counts, and the share of them lent; the comparison says how far the model is from the run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.selector import geometric_tokens
from tailspec.simulate.drafter import FixedAcceptance
from tailspec.simulate.lending import Latencies
from tailspec.simulate.step import StepInputs, run_step


@dataclass
class Calibration:
    run_dir: str
    mode: str
    steps: int
    measured: dict[str, float]
    predicted: dict[str, float]
    rel_error: dict[str, float]
    per_step_rollout_rel_error: list[float]

    @property
    def max_rel_error(self) -> float:
        return max(self.rel_error.values())

    def to_dict(self) -> dict:
        return {"label": "projection vs measured", "run_dir": self.run_dir, "mode": self.mode, "steps": self.steps,
                "measured": self.measured, "predicted": self.predicted, "rel_error": self.rel_error,
                "max_rel_error": self.max_rel_error,
                "per_step_rollout_rel_error_median": float(np.median(self.per_step_rollout_rel_error))}


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    d = Path(run_dir)
    try:
        record = json.loads((d / "run.json").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: not a recorded demo run (run.json and metrics.jsonl): {e}") from e
    if not rows or not rows[0].get("worker_lengths") or not record.get("cost_models"):
        raise ValueError(f"{d}: the run has no per-worker lengths or cost tables (recorded before they were kept)")
    return record, rows


def measured_acceptance(rows: list[dict], k_max: int) -> FixedAcceptance | None:
    """E[tokens per row per step | k] over the run's steps. A k never run takes the per-token rate that
    reproduces the nearest run k's tokens (below it if any): deep drafts accept less than the first ones, so
    the rate of a short k would overstate a long one."""
    acc: dict[int, list[int]] = {}
    for r in rows:
        for k, (n, a) in r.get("accepted_by_k", {}).items():
            cell = acc.setdefault(int(k), [0, 0])
            cell[0] += n
            cell[1] += a
    seen = {k: 1 + a / n for k, (n, a) in acc.items() if k > 0 and n > 0}
    if not seen:
        return None

    def rate(k: int) -> float:  # per-token rate whose chain gives k's measured tokens
        lo, hi = 0.0, 0.999
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if geometric_tokens(mid, k) < seen[k] else (lo, mid)
        return lo

    tokens = [1.0]
    for k in range(1, k_max + 1):
        if k in seen:
            tokens.append(seen[k])
        else:
            below = [j for j in seen if j < k]
            near = max(below) if below else min(seen)
            tokens.append(geometric_tokens(rate(near), k))
    return FixedAcceptance(tokens)


def calibrate(run_dir: str | Path, online: bool = True) -> Calibration:
    """Replay `run_dir`. online: step i's cost tables are the engines' own after step i - 1 (the warm-up
    table for step 0); False: the warm-up tables throughout."""
    record, rows = load_run(run_dir)
    cfg, opts = record["config"], record["options"]
    workers = sorted(record["cost_models"])
    warmup = [CostModel.from_dict(record["cost_models"][w]) for w in workers]
    mode = opts.get("mode", "cotrained")
    rc, sc = cfg["rollout"], cfg["scheduler"]
    acceptance = measured_acceptance(rows, rc["k_max"]) if mode != "nospec" else None

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs)) if xs else 0.0

    dispatch = mean([r["rollout_time_s"] - max(r["worker_busy_s"].values()) for r in rows]) / 2
    lent_rows = [r for r in rows if r["lent_gpu_seconds"] > 0]
    lat = Latencies(see_s=sc["tick_s"] / 2, telemetry_s=sc["sample_period_s"] / 2, window_s=sc["idle_window_s"],
                    tick_s=sc["tick_s"], startup_s=sc["session_startup_s"],
                    stop_s=mean([r["wait_sessions_s"] for r in lent_rows]) if lent_rows else 0.1)
    train_s = mean([r["train_time_s"] - r["wait_sessions_s"] for r in rows])
    pred = {"rollout_s": [], "idle": [], "lent": []}
    costs = warmup
    for r in rows:
        lengths = [r["worker_lengths"].get(w, []) for w in workers]
        n = max(len(x) for x in lengths)
        arr = np.zeros((len(workers), n))
        for i, x in enumerate(lengths):
            arr[i, : len(x)] = x
        fixed = np.array([r["worker_busy_s"][w] - r["worker_decode_s"][w] for w in workers])
        out = run_step(StepInputs(arr, min(rc["max_batch"], n), costs, acceptance, fixed, train_s, 1, lat,
                                  lend=mode == "cotrained", drafter_tokens_per_s=0.0, dispatch_s=dispatch))
        pred["rollout_s"].append(out.rollout_s)
        pred["idle"].append(out.idle_gpu_s)
        pred["lent"].append(out.lent_gpu_s)
        # the next step is predicted with what each engine's cost model knew when it began: the warm-up table
        # corrected by the steps it ran so far
        if online:
            after = r.get("worker_cost", {})
            costs = [CostModel.from_dict(after[w]) if w in after else c for w, c in zip(workers, costs)]
    meas_roll = [r["rollout_time_s"] for r in rows]
    meas_idle = sum(r["idle_gpu_seconds"] for r in rows)
    meas_lent = sum(r["lent_gpu_seconds"] for r in rows)
    measured = {"rollout_s": mean(meas_roll), "idle_gpu_s": meas_idle,
                "reclaimed_share": meas_lent / meas_idle if meas_idle else 0.0}
    p_idle = sum(pred["idle"])
    predicted = {"rollout_s": mean(pred["rollout_s"]), "idle_gpu_s": p_idle,
                 "reclaimed_share": sum(pred["lent"]) / p_idle if p_idle else 0.0}
    rel = {k: abs(predicted[k] - v) / v if v else (0.0 if predicted[k] == 0 else math.inf) for k, v in measured.items()}
    if mode != "cotrained":
        rel.pop("reclaimed_share")
    per_step = [abs(p - m) / m for p, m in zip(pred["rollout_s"], meas_roll)]
    return Calibration(str(run_dir), mode, len(rows), measured, predicted, rel, per_step)
