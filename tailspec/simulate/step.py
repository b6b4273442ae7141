"""One RL step of a projection: rollout on every replica, lending in the tail, the update, the reclaim wait.

Synchronous pipeline: the rollout phase ends when the last replica finishes; the trainer waits for every
lent replica to be reclaimed, updates the policy on all GPUs and broadcasts the weights. Asynchronous
(off-policy by one step): rollout and training run on separate pools at the same time, so a step lasts
the longer of the two; the rollout pool stays in its rollout phase (and lendable) until the next rollout
can start, the training pool idles when it is the shorter.

Every GPU-second of the step is in exactly one state (`STATES`), so the states sum to GPUs x step time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tailspec.rollout.cost_model import CostModel
from tailspec.simulate.drafter import FixedAcceptance
from tailspec.simulate.lending import Latencies, Lending, decide
from tailspec.simulate.replica import finish_times, ks_by_batch, seconds_per_token, width_seconds_per_token

STATES = ("decode", "tail_idle", "lent_starting", "lent_training", "lent_validating", "reclaiming", "train",
          "pool_idle")


@dataclass
class StepInputs:
    lengths: np.ndarray  # [replicas, requests] response lengths in arrival order (0: no request)
    max_batch: int
    costs: list[CostModel]  # one per replica, or one for all
    acceptance: FixedAcceptance | None  # None: plain decoding
    fixed_s: np.ndarray  # per replica, seconds of the rollout outside decode steps (prefill, set-up)
    train_s: float  # the RL update and the weight broadcast
    tp: int
    lat: Latencies
    lend: bool
    drafter_tokens_per_s: float  # drafter training throughput of one lent replica
    pipeline: Literal["sync", "async"] = "sync"
    train_gpus: int = 0  # async: GPUs of the training pool (sync: every GPU trains)
    dispatch_s: float = 0.0  # rollout phase start → the replicas start (and last finish → phase end)
    fixed_k: int | None = None  # one draft length at every batch size instead of the adaptive selector
    # context-dependent attention: attn_s(cost, b, k) seconds per step per position of attention width beyond
    # the cost table's, and each request's width at its first step minus the table's ([replicas, requests]);
    # None: the cost table alone. The width is the widest running row's (the native engine, calibration) or,
    # with per_row, every running row's own (paged attention, the cluster projection)
    attn_s: Callable[[CostModel, int, int], float] | None = None
    ctx0: np.ndarray | None = None
    per_row: bool = False
    validation_s: float = 0.0  # one candidate's paired validation on a lent replica (0: none modelled)


@dataclass
class StepOut:
    rollout_s: float  # phase start → the last replica done
    step_s: float
    finish: np.ndarray  # per replica, seconds from the phase start
    lending: Lending
    phase_end: float
    wait_s: float  # the trainer's wait for reclaim
    tail_idle_gpu_s: float  # Σ over rollout GPUs of (phase end − own done): the long tail's idle time
    idle_gpu_s: float  # what the scheduler counts idle (drain seen → phase change seen: lending.py)
    lent_gpu_s: float  # lease granted → revoked (the phase change seen)
    training_gpu_s: float  # of those, after the session started and not validating
    drafter_tokens: float
    validating: np.ndarray  # per replica, seconds of its lent time spent validating (at its end)
    states: dict[str, float] = field(default_factory=dict)  # GPU-seconds per state


def validations(training: np.ndarray, validation_s: float) -> np.ndarray:
    """Seconds each lent replica validates. A lent session proposes its lineage head about once per lend (the
    miniature's sessions: 12 validations in 29 lends), each validation takes `validation_s`, and one runs at a
    time cluster-wide (docs/architecture.md, Promotion), so together they fit in the longest lent interval: the
    replicas lent longest validate first, until that interval is used up."""
    v = np.zeros_like(training)
    budget = float(training.max(initial=0.0))
    for i in np.argsort(-training, kind="stable"):
        if training[i] <= 0 or budget <= 0:
            break
        v[i] = min(validation_s, training[i], budget)
        budget -= v[i]
    return v


def run_step(inp: StepInputs) -> StepOut:
    r = inp.lengths.shape[0]
    costs = inp.costs if len(inp.costs) == r else [inp.costs[0]] * r
    finish = np.empty(r)
    groups: dict[int, list[int]] = {}  # replicas sharing a cost model are decoded together
    for i, c in enumerate(costs):
        groups.setdefault(id(c), []).append(i)
    top = min(inp.max_batch, inp.lengths.shape[1])  # no replica runs a larger batch than it has requests
    for idx in groups.values():
        ks = ks_by_batch(costs[idx[0]], inp.acceptance, top, inp.fixed_k)
        g = seconds_per_token(costs[idx[0]], inp.acceptance, top, ks=ks)
        h = ctx0 = None
        if inp.attn_s is not None and inp.ctx0 is not None:
            h = width_seconds_per_token(inp.attn_s, costs[idx[0]], inp.acceptance, top, ks=ks)
            ctx0 = inp.ctx0[idx]
        finish[idx] = finish_times(inp.lengths[idx], top, g, h, ctx0, inp.per_row).max(axis=1)
    finish = finish + inp.fixed_s + inp.dispatch_s
    rollout_end = float(finish.max()) + inp.dispatch_s
    train_end = inp.train_s if inp.pipeline == "async" else 0.0
    phase_end = max(rollout_end, train_end)
    lend = decide(finish, phase_end, inp.tp, inp.lat, inp.lend)
    lent = ~np.isnan(lend.lent)
    wait = float(np.nanmax(lend.reclaimed) - phase_end) if lent.any() else 0.0
    rollout_pool_s = phase_end + wait
    step_s = rollout_pool_s + (inp.train_s if inp.pipeline == "sync" else 0.0)
    if inp.pipeline == "async":
        step_s = max(rollout_pool_s, inp.train_s)
    start_train = np.where(lent, lend.lent + inp.lat.startup_s, np.nan)
    training = np.where(lent, np.clip(phase_end - start_train, 0, None), 0.0)
    starting = np.where(lent, np.minimum(phase_end, start_train) - lend.lent, 0.0)
    validating = validations(training, inp.validation_s) if inp.validation_s > 0 else np.zeros(r)
    training = training - validating
    reclaiming = np.where(lent, lend.reclaimed - phase_end, 0.0)
    tp = inp.tp
    states = {s: 0.0 for s in STATES}
    states["decode"] = tp * float(finish.sum())
    states["lent_starting"] = tp * float(starting.sum())
    states["lent_training"] = tp * float(training.sum())
    states["lent_validating"] = tp * float(validating.sum())
    states["reclaiming"] = tp * float(reclaiming.sum())
    # everything else a rollout GPU spends before the update is idle: the tail (unlent), the wait for others'
    # reclaim, and in async the wait for the trainer
    busy = sum(states[x] for x in ("decode", "lent_starting", "lent_training", "lent_validating", "reclaiming"))
    states["tail_idle"] = tp * r * rollout_pool_s - busy
    if inp.pipeline == "sync":
        states["train"] = tp * r * inp.train_s
    else:
        states["train"] = inp.train_gpus * inp.train_s
        states["pool_idle"] = inp.train_gpus * (step_s - inp.train_s) + tp * r * (step_s - rollout_pool_s)
    seen = np.where(np.isnan(lend.seen), lend.phase_seen, lend.seen)  # a drain seen with the phase change: 0
    return StepOut(
        rollout_s=rollout_end, step_s=step_s, finish=finish, lending=lend, phase_end=phase_end, wait_s=wait,
        tail_idle_gpu_s=tp * float((phase_end - finish).sum()),
        idle_gpu_s=tp * float((lend.phase_seen - seen).sum()),
        lent_gpu_s=tp * float(np.nansum(lend.revoked - lend.lent)),
        training_gpu_s=tp * float(training.sum()),
        drafter_tokens=float(training.sum()) * inp.drafter_tokens_per_s,
        states=states, validating=validating,
    )
