"""A projection of RL steps on a cluster: the same steps without speculation, with a frozen drafter and with
a drafter co-trained on the lent tail GPUs, on the same response lengths.

Costs come from the roofline (`hardware.py`), k per batch size from the engine's selector, lending from the
scheduler's idle state machine, acceptance from `DrafterCurve` and the training each step actually lent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from tailspec.rollout.cost_model import CostModel
from tailspec.simulate import hardware as hw
from tailspec.simulate.drafter import DrafterCurve, DrafterState, FixedAcceptance
from tailspec.simulate.lending import Latencies
from tailspec.simulate.step import STATES, StepInputs, StepOut, run_step

MODES = ("nospec", "frozen", "cotrained")
LABEL = "projection"  # every output says what it is


@dataclass(frozen=True)
class Scenario:
    model: str = "qwen2.5-7b"
    gpu: str = "H100"
    gpus: int = 64
    tp: int | None = None  # per replica; None: the smallest that leaves room for the KV cache
    pipeline: Literal["sync", "async"] = "sync"
    rollout_share: float = 0.75  # async: share of the GPUs in the rollout pool
    prompts_per_replica: float = 4.0  # prompts per step = this x rollout replicas
    group: int = 16
    prompt_len: int = 512
    length_median: float = 1500.0
    length_sigma: float = 0.9  # log-normal sigma of a response's length
    prompt_share: float = 0.5  # share of the log-variance a prompt's group has in common
    max_len: int = 16384
    lengths_trace: str | None = None  # JSONL of response lengths (a number or {"length": n} per line)
    max_batch: int = 256
    k_max: int = 8
    k: int | None = None  # one draft length at every batch size; None: the engine's adaptive selector
    steps: int = 20
    seed: int = 0
    curve: DrafterCurve = field(default_factory=DrafterCurve)
    lat: Latencies | None = None  # None: the config defaults with the modelled session start-up
    train_mfu: float = 0.4
    drafter_mfu: float = 0.3
    max_epochs: float = 2.0  # a step's drafter training is capped at this many passes over its fresh samples
    validation_samples: int = 64  # held-out samples a candidate is validated on (trainer.validation_samples)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.steps < 1 or self.group < 1 or self.max_batch < 1 or self.k_max < 0:
            raise ValueError("gpus, steps, group and max_batch must be >= 1 and k_max >= 0")
        if self.pipeline not in ("sync", "async"):
            raise ValueError(f"pipeline must be sync or async, got {self.pipeline!r}")
        if not 0 < self.rollout_share < 1 or self.length_median < 1 or self.length_sigma < 0:
            raise ValueError("need 0 < rollout_share < 1, length_median >= 1 and length_sigma >= 0")
        if self.validation_samples < 0:
            raise ValueError(f"validation_samples must be >= 0 (0: no validation modelled), got {self.validation_samples}")


@dataclass
class Row:
    step: int
    mode: str
    step_s: float
    rollout_s: float
    train_s: float
    wait_s: float
    tail_idle_gpu_s: float
    idle_gpu_s: float
    lent_gpu_s: float
    training_gpu_s: float
    alpha: float
    drafter_tokens: float
    states: dict[str, float]


@dataclass
class Projection:
    scenario: Scenario
    tp: int
    replicas: int
    rows: list[Row]
    startup_s: float = 0.0  # a lent replica's session start-up
    gantt: dict[str, StepOut] = field(default_factory=dict)  # mode -> the last step (for the plot)

    def mode_rows(self, mode: str) -> list[Row]:
        return [r for r in self.rows if r.mode == mode]

    def summary(self) -> dict:
        mean = {m: float(np.mean([r.step_s for r in self.mode_rows(m)])) for m in MODES}
        roll = {m: float(np.mean([r.rollout_s for r in self.mode_rows(m)])) for m in MODES}
        co = self.mode_rows("cotrained")
        tail = sum(r.tail_idle_gpu_s for r in co)
        idle = sum(r.idle_gpu_s for r in co)
        return {
            "label": LABEL,
            "model": self.scenario.model, "gpu": self.scenario.gpu, "gpus": self.scenario.gpus, "tp": self.tp,
            "pipeline": self.scenario.pipeline, "replicas": self.replicas, "steps": self.scenario.steps,
            "step_s": mean, "rollout_s": roll,
            "speedup_cotrained": mean["nospec"] / mean["cotrained"],
            "speedup_frozen": mean["nospec"] / mean["frozen"],
            "speedup_vs_frozen": mean["frozen"] / mean["cotrained"],
            "rollout_speedup_cotrained": roll["nospec"] / roll["cotrained"],
            "rollout_speedup_frozen": roll["nospec"] / roll["frozen"],
            "tail_idle_share": tail / max(sum(r.states["decode"] + r.tail_idle_gpu_s for r in co), 1e-9),
            "reclaimed_share": sum(r.lent_gpu_s for r in co) / idle if idle else 0.0,
            "training_share_of_tail": sum(r.training_gpu_s for r in co) / tail if tail else 0.0,
            "validating_share_of_tail": sum(r.states["lent_validating"] for r in co) / tail if tail else 0.0,
            "alpha_first_last": {m: [self.mode_rows(m)[0].alpha, self.mode_rows(m)[-1].alpha] for m in ("frozen", "cotrained")},
        }


def read_trace(path: str | Path) -> np.ndarray:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            v = json.loads(line)
            v = v["length"] if isinstance(v, dict) else v
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 1):
                raise ValueError(f"a length must be a number >= 1, got {v!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        out.append(float(v))
    if not out:
        raise ValueError(f"{path}: no lengths")
    return np.asarray(out)


def step_lengths(sc: Scenario, rng: np.random.Generator, replicas: int, trace: np.ndarray | None) -> np.ndarray:
    """One step's response lengths, prompt-major (a group's responses together), dealt to replicas in
    contiguous chunks the way verl and OpenRLHF split a batch; [replicas, requests per replica]."""
    prompts = max(1, round(sc.prompts_per_replica * replicas))
    if trace is not None:
        lengths = rng.choice(trace, size=(prompts, sc.group))
    else:
        s_p = sc.length_sigma * math.sqrt(sc.prompt_share)
        s_r = sc.length_sigma * math.sqrt(1 - sc.prompt_share)
        mu = math.log(sc.length_median) + rng.normal(0, s_p, size=(prompts, 1))
        lengths = np.exp(mu + rng.normal(0, s_r, size=(prompts, sc.group)))
    flat = np.clip(np.round(lengths).ravel(), 1, sc.max_len)
    per = -(-flat.size // replicas)
    out = np.zeros(replicas * per)
    out[: flat.size] = flat
    return out.reshape(replicas, per)


def simulate(sc: Scenario) -> Projection:
    model, gpu = hw.resolve_model(sc.model), hw.resolve_gpu(sc.gpu)
    tp = sc.tp or hw.min_tp(model, gpu)
    rollout_gpus = sc.gpus if sc.pipeline == "sync" else max(tp, int(sc.gpus * sc.rollout_share) // tp * tp)
    train_gpus = sc.gpus if sc.pipeline == "sync" else sc.gpus - rollout_gpus
    if sc.gpus % tp:
        raise ValueError(f"{sc.gpus} GPUs is not a multiple of the replica size tp={tp}")
    replicas = rollout_gpus // tp
    if replicas < 1 or train_gpus < 1:
        raise ValueError(f"{sc.gpus} GPUs cannot hold one {tp}-GPU replica of {model.name} (and a training pool)")
    roof = hw.Roofline(model, gpu, tp)
    # The selector's table is timed at the rows' first-step context, as an engine times its table at warm-up;
    # each step then pays the KV reads of every running row's own context beyond it (context_slope).
    cost = roof.cost_model(sc.max_batch, sc.k_max, context=sc.prompt_len)
    attn_s = context_slope(roof, sc.prompt_len, sc.prompt_len + sc.max_len)
    startup = hw.session_startup_s(model, tp)
    lat = sc.lat or Latencies(startup_s=startup)
    draft_tps = hw.drafter_tokens_per_s(model, gpu, tp, sc.drafter_mfu)
    val_s = hw.validation_s(model, gpu, tp, sc.validation_samples * (sc.prompt_len + sc.length_median), sc.drafter_mfu)
    trace = read_trace(sc.lengths_trace) if sc.lengths_trace else None
    rng = np.random.default_rng(sc.seed)
    drafters = {"frozen": DrafterState(sc.curve), "cotrained": DrafterState(sc.curve)}
    proj = Projection(sc, tp, replicas, [], lat.startup_s)
    for step in range(sc.steps):
        lengths = step_lengths(sc, rng, replicas, trace)
        n = int((lengths > 0).sum())
        tokens = float(lengths.sum())
        prefill = roof.prefill_s(min(lengths.shape[1], sc.max_batch), sc.prompt_len) * -(-lengths.shape[1] // sc.max_batch)
        train_s = hw.train_step_s(model, gpu, train_gpus, tokens + n * sc.prompt_len, sc.train_mfu) + hw.weight_sync_s(model)
        for mode in MODES:
            d = drafters.get(mode)
            acc = FixedAcceptance.geometric(d.alpha, sc.k_max) if d is not None else None
            out = run_step(StepInputs(lengths, sc.max_batch, [cost], acc, np.full(replicas, prefill), train_s, tp, lat,
                                      lend=mode == "cotrained", drafter_tokens_per_s=draft_tps,
                                      pipeline=sc.pipeline, train_gpus=train_gpus, fixed_k=sc.k,
                                      validation_s=val_s, attn_s=attn_s, ctx0=np.zeros_like(lengths), per_row=True))
            trained = min(out.drafter_tokens, sc.max_epochs * tokens) if mode == "cotrained" else 0.0
            proj.rows.append(Row(step, mode, out.step_s, out.rollout_s, train_s, out.wait_s, out.tail_idle_gpu_s,
                                 out.idle_gpu_s, out.lent_gpu_s, out.training_gpu_s, d.alpha if d else 0.0, trained,
                                 out.states))
            if d is not None:
                if trained:
                    d.train(trained)  # refreshed toward the policy that taught it during this rollout
                d.policy_step()
            if step == sc.steps - 1:
                proj.gantt[mode] = out
    return proj


def context_slope(roof: hw.Roofline, lo: float, hi: float) -> Callable[[CostModel | None, int, int], float]:
    """attn_s for StepInputs: a step's seconds per position of one running row's context, the secant of the
    roofline's step time between contexts `lo` and `hi` (a row's first step and the longest). A step's time is
    the larger of its memory and compute times, each linear in the context, so it is convex in it and the
    secant is never below it between the two: where a verify of many rows is compute-bound at short contexts,
    the projection errs toward the slower speculative step. Plain decode is memory-bound throughout: exact."""
    cache: dict[tuple[int, int], float] = {}

    def attn_s(_cost: CostModel | None, b: int, k: int) -> float:
        got = cache.get((b, k))
        if got is None:
            got = cache[b, k] = (roof.step_s(b, k, hi) - roof.step_s(b, k, lo)) / (b * (hi - lo))
        return got

    return attn_s


def rows_json(proj: Projection) -> list[dict]:
    return [asdict(r) for r in proj.rows]


__all__ = ["LABEL", "MODES", "STATES", "Projection", "Row", "Scenario", "read_trace", "simulate", "step_lengths"]
