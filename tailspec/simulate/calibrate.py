"""Calibration: replay a recorded `tailspec demo` run through the projection and compare.

The projection is fed what the run measured *as costs*, never its outcomes: each worker's cost table t(b, k)
as its engine knew it before the step (run.json's warm-up table, corrected by the steps before), the response lengths each worker decoded (metrics.jsonl), the drafts accepted per
k over the whole run, each worker's mean seconds outside decode steps (set-up, admissions), the RL update's
mean time and the scheduler's configured delays. It predicts each step's rollout time, the idle GPU-seconds
the scheduler counts, and the share of them lent; the comparison says how far the model is from the run.

The cost table is timed at warm-up on short contexts, but the native engine's attention grows with the
context: every row of a step attends over the cache up to the longest running row (`rollout/model_runner.py`,
rounded up to 64 positions), 4 FLOPs per query, position and head dimension per layer, for the k + 1 verified
tokens over the target's layers and for each of the k drafter forwards over its one layer. `EngineAttention`
prices a position of width at the seconds per FLOP of the warm-up table's per-row slope (one more row at k = 0
costs the FLOPs of one token: 2 per parameter plus attention at the warm-up's width), so a tail of long rows
at batch 1-2 pays for its context. Prompt lengths come from the task's format (runsum: BOS + 3 tokens per
number, a well-formed response 8 per number + 3); with another task the context term is off.

The idle GPU-seconds compared are those the scheduler counted: from the tick that read a worker's drain report
to the tick that read the phase change (`counting_window`, lending.py), each step's window from its record.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.selector import geometric_tokens
from tailspec.simulate import hardware as hw
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


def read_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """run.json and the rows of metrics.jsonl of a recorded demo run, as recorded."""
    d = Path(run_dir)
    try:
        record = json.loads((d / "run.json").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: not a recorded demo run (run.json and metrics.jsonl): {e}") from e
    return record, rows


def load_run(run_dir: str | Path, need_costs: bool = True) -> tuple[dict, list[dict]]:
    """run.json and metrics.jsonl of a recorded demo run, with what calibration replays: the per-worker lengths
    and, with need_costs, the workers' warm-up cost tables (a run without a drafter times none)."""
    d = Path(run_dir)
    record, rows = read_run(d)
    if not rows or not rows[0].get("worker_lengths") or (need_costs and not record.get("cost_models")):
        raise ValueError(f"{d}: the run has no per-worker lengths or cost tables (recorded before they were kept)")
    return record, rows


def measured_acceptance(rows: list[dict], k_max: int) -> FixedAcceptance | None:
    """E[tokens per row per step | k] over the run's steps. A k never run takes the per-token rate that
    reproduces the nearest run k's tokens (below it if any): deep drafts accept less than the first ones, so
    the rate of a short k would overstate a long one."""
    acc: dict[int, list[int]] = {}
    for r in rows:
        for k, (n, a) in r.get("accepted_by_k", {}).items():
            if not k.isdigit():
                continue  # a tree strategy (its label): the projection's selector picks among chains
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


ATTN_BUCKET = 64  # rollout/model_runner.py ModelRunner(attn_bucket=64): attention width rounded up to a multiple
WARMUP_PROMPTS = 8  # tailspec/demo/worker.py _measure_cost: the warm-up cycles the step's first 8 prompts


def runsum_prompt_len(length: float) -> int:
    """Prompt tokens of a runsum response of `length` tokens (tailspec/tasks/runsum.py): a well-formed
    main-style response is 8 tokens per number + '#d' + EOS, the prompt BOS + 3 per number ('a3,')."""
    return 1 + 3 * max(1, round((length - 3) / 8))


@dataclass(frozen=True)
class EngineAttention:
    """Seconds per step per position of attention width beyond the warm-up table's, for the native engine.
    A callable `attn_s(cost, b, k)` for `StepInputs.attn_s`."""

    model: hw.ModelSpec
    seconds_per_flop: float
    warm: CostModel  # the warm-up table: cost.t / warm.t is the machine's level as the engine knows it now

    @classmethod
    def from_warmup(cls, model: hw.ModelSpec, warm: CostModel, warm_width: float) -> EngineAttention:
        """The per-row slope of the warm-up table at k = 0 is one row-token's FLOPs (2 per parameter plus
        attention at the warm-up's mean width) at the machine's seconds per FLOP."""
        b0, b1 = warm.buckets[0], warm.buckets[-1]
        slope = (warm.t(b1, 0) - warm.t(b0, 0)) / (b1 - b0) if b1 > b0 else 0.0
        return cls(model, max(slope, 0.0) / model.flops_per_token(warm_width), warm)

    def flops_per_position(self, b: int, k: int) -> float:
        m = self.model
        return 4 * m.heads * m.head_dim * b * ((k + 1) * m.layers + k)

    def __call__(self, cost: CostModel, b: int, k: int) -> float:
        return self.seconds_per_flop * self.flops_per_position(b, k) * cost.t(b, k) / self.warm.t(b, k)


def policy_model(policy: str | None) -> hw.ModelSpec | None:
    """The run's policy dimensions from its directory's config.json; None where it is not there (a caller may
    know them another way: `tailspec.commands.simulate.run_policy_model` also reads the preset's)."""
    if policy and (Path(policy) / "config.json").exists():
        return hw.model_from_hf_config(policy)
    return None


def warmup_width(lengths: list[float]) -> float:
    """Mean attention width of the warm-up: one row at a time through the first prompts' responses."""
    ls = [x for x in lengths[:WARMUP_PROMPTS] if x > 0]
    if not ls:
        return ATTN_BUCKET / 2
    return sum(runsum_prompt_len(x) * x + x * x / 2 for x in ls) / sum(ls) + ATTN_BUCKET / 2


def engine_context(record: dict, rows: list[dict], workers: list[str], warmup: list[CostModel],
                   model: hw.ModelSpec | None) -> tuple[list[EngineAttention], list[float]] | None:
    """Per worker, the attention pricing and the warm-up width; None where the run's task or policy is unknown."""
    model = model or policy_model(record["options"].get("policy"))
    if model is None or record["config"].get("task", {}).get("name") != "runsum":
        return None
    widths = [warmup_width(rows[0]["worker_lengths"].get(w, [])) for w in workers]
    return [EngineAttention.from_warmup(model, c, wd) for c, wd in zip(warmup, widths)], widths


FLUSH_POLL_S = 0.005  # scheduler/client.py TailspecClient.flush: it sleeps this long between checks


def counting_window(r: dict, tick_s: float) -> tuple[float, float]:
    """(phase_s, lead_s) of `Latencies` for one recorded step: the scheduler counts a drained GPU idle from the
    tick that reads its worker's drain report to the tick that reads the phase change (lending.py). The drain
    report precedes the worker's result by the time it builds the result (`worker_drain_lead_s`, recorded by
    runs since it was kept; else 0); the trainer changes the phase after the last result has crossed to it
    (`phase_lag_s`, likewise). A run recorded before either was kept bounds the lag from above by the step's
    time outside its rollout and its update (the requests and the rollout phase's write before the rollout,
    the result's transfer and the phase change after it), less the trainer's two `client.flush` waits: each
    returns one poll after the phase write it waits for. Each read comes at the next tick, tick / 2 on average
    (both ends: their expected distance is that of the writes)."""
    lag = r.get("phase_lag_s")
    if lag is None:
        lag = max(0.0, r["step_time_s"] - r["rollout_time_s"] - r["train_time_s"] - 2 * FLUSH_POLL_S)
    leads = list(r.get("worker_drain_lead_s", {}).values())
    return tick_s / 2 + lag, float(np.mean(leads)) if leads else 0.0


def lengths_array(r: dict, workers: list[str]) -> np.ndarray:
    lengths = [r["worker_lengths"].get(w, []) for w in workers]
    arr = np.zeros((len(workers), max(len(x) for x in lengths)))
    for i, x in enumerate(lengths):
        arr[i, : len(x)] = x
    return arr


def replay_step(inp: StepInputs, ctx: tuple[list[EngineAttention], list[float]] | None):
    """One replayed step, each worker's attention priced by its own `EngineAttention` when given."""
    if ctx is None:
        return run_step(inp)
    att, widths = ctx
    prompts = np.vectorize(runsum_prompt_len)(inp.lengths)
    inp.ctx0 = prompts + ATTN_BUCKET / 2 - np.asarray(widths)[:, None]
    per = {id(c): a for c, a in zip(inp.costs, att)}
    inp.attn_s = lambda cost, b, k: per[id(cost)](cost, b, k)
    return run_step(inp)


def scaled_cost(cost: CostModel, level: float) -> CostModel:
    return CostModel(list(cost.buckets), list(cost.ks), {key: v * level for key, v in cost.table.items()})


def _replay(rows: list[dict], workers: list[str], warmup: list[CostModel], online: bool,
            ctx: tuple[list[EngineAttention], list[float]] | None, step_inputs) -> dict[str, list[float]]:
    """Each step's projected rollout seconds, idle and lent GPU-seconds. The cost tables of step i: the
    warm-up tables (online False); with the context term, the warm-up tables at each worker's machine level,
    the previous steps' measured decode seconds over their projection at level 1 (the engine's online
    correction, made context-aware: the engine's own corrected tables fold the long-context steps it ran into
    their entries, which the context term would count again); without it, the engines' own tables after the
    previous step."""
    pred: dict[str, list[float]] = {"rollout_s": [], "idle": [], "lent": []}
    costs, level = warmup, np.ones(len(workers))
    measured_sum, base_sum = np.zeros(len(workers)), np.zeros(len(workers))
    for r in rows:
        inp = step_inputs(r, costs)
        out = replay_step(inp, ctx)
        pred["rollout_s"].append(out.rollout_s)
        pred["idle"].append(out.idle_gpu_s)
        pred["lent"].append(out.lent_gpu_s)
        if not online:
            continue
        if ctx is None:
            after = r.get("worker_cost", {})
            costs = [CostModel.from_dict(after[w]) if w in after else c for w, c in zip(workers, costs)]
            continue
        decode = out.finish - inp.fixed_s - inp.dispatch_s
        measured_sum += [r["worker_decode_s"][w] for w in workers]
        base_sum += decode / level
        level = np.where(base_sum > 0, measured_sum / np.maximum(base_sum, 1e-12), 1.0)
        costs = [scaled_cost(c, lv) for c, lv in zip(warmup, level)]
    return pred


def calibrate(run_dir: str | Path, online: bool = True, context: bool = True,
              model: hw.ModelSpec | None = None) -> Calibration:
    """Replay `run_dir`. online: step i's costs follow what the steps before it measured (see `_replay`);
    False: the warm-up tables throughout. context: price the attention width beyond the warm-up's
    (`EngineAttention`) for the policy `model` (None: the run's policy directory's config.json; neither:
    off); False: the cost tables alone."""
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
                    # a run recorded before workers reported their memory released (no such key) used the window
                    on_release=sc.get("lend_on_release", False),
                    stop_s=mean([r["wait_sessions_s"] for r in lent_rows]) if lent_rows else 0.1)
    train_s = mean([r["train_time_s"] - r["wait_sessions_s"] for r in rows])

    def step_inputs(r: dict, costs: list[CostModel]) -> StepInputs:
        arr = lengths_array(r, workers)
        fixed = np.array([r["worker_busy_s"][w] - r["worker_decode_s"][w] for w in workers])
        phase_s, lead_s = counting_window(r, sc["tick_s"])
        step_lat = replace(lat, phase_s=phase_s, lead_s=lead_s)
        return StepInputs(arr, min(rc["max_batch"], arr.shape[1]), costs, acceptance, fixed, train_s, 1, step_lat,
                          lend=mode == "cotrained", drafter_tokens_per_s=0.0, dispatch_s=dispatch)

    ctx = engine_context(record, rows, workers, warmup, model) if context else None
    pred = _replay(rows, workers, warmup, online, ctx, step_inputs)
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
