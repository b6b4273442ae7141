"""What the demo measures around each RL step: the step's row of figures (metrics.jsonl, the report), both
drafters' acceptance on the step's own samples, the drafter's health record, the rollout stats the dashboards
plot, and the promotions of a run. Instrumentation only: nothing here feeds back into the RL loop."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from tailspec.core import state
from tailspec.core.state import DrafterVersion, Sample
from tailspec.demo.bootstrap import BOOTSTRAP_SESSION
from tailspec.demo.protocol import WorkResult
from tailspec.drafter_trainer.model import Eagle3Module
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.validation import validate
from tailspec.session_entry import SESSION_SECONDS
from tailspec.tasks.runsum import ALT

log = logging.getLogger("tailspec.demo")


@dataclass
class StepRow:
    step: int
    mode: str
    step_time_s: float
    rollout_time_s: float
    train_time_s: float
    # train_time_s = step_time_s - rollout_time_s (grade, GRPO update, publish, wait for revoked sessions);
    # measure_s (logprob check, acceptance of both drafters) is instrumentation outside step_time_s.
    measure_s: float
    wait_sessions_s: float
    idle_gpu_seconds: float
    lent_gpu_seconds: float
    drafter_version: int | None
    acceptance_length: float
    acceptance_frozen: float | None
    acceptance_cotrained: float | None
    tokens: int
    rollout_tokens_per_s: float
    mean_reward: float
    accuracy: float
    policy_version: int
    logprob_max_abs_diff: float
    sessions: int
    t_start: float = 0.0
    t_end: float = 0.0
    # GPU-seconds of the rollout during which a worker had finished and the slowest had not (the long tail's
    # idle time, from the workers' own clocks), and their share of workers x rollout time
    tail_idle_gpu_seconds: float = 0.0
    tail_idle_share: float = 0.0
    worker_busy_s: dict[str, float] = field(default_factory=dict)
    strategy_mix: dict[str, int] = field(default_factory=dict)
    # per worker: response lengths, engine set-up and decode seconds; k -> [rows, accepted] over the step
    # (what `tailspec simulate --calibrate` replays)
    worker_lengths: dict[str, list[int]] = field(default_factory=dict)
    # where the lent GPU-seconds went, by the sessions that ended in the step (tailspec.session_entry.SESSION_SECONDS):
    # ready (start-up), train (whole optimizer steps), validate, and all of it
    session_seconds: dict[str, float] = field(default_factory=dict)
    worker_setup_s: dict[str, float] = field(default_factory=dict)
    worker_decode_s: dict[str, float] = field(default_factory=dict)
    accepted_by_k: dict[str, list[int]] = field(default_factory=dict)
    worker_cost: dict[str, dict] = field(default_factory=dict)  # each engine's cost model after the step
    # the scheduler's counting window (tailspec/simulate/lending.py): the last result → the phase change, and per
    # worker its drain report → its result
    phase_lag_s: float = 0.0
    worker_drain_lead_s: dict[str, float] = field(default_factory=dict)
    worker_finished_at: dict[str, float] = field(default_factory=dict)  # each worker's last result (time.time())
    # share of the step's responses written well-formed in the task's alternative scratchpad style: the drift
    # the reward's style bonus drives (tailspec/tasks/runsum.py)
    alt_style_share: float = 0.0
    # the policy's mean token entropy (nats, at the rollout's temperature) on this step's measured responses, and the
    # k3 estimate of KL(last step's policy || this step's) on the last step's (tailspec/rl.py: policy_drift); the
    # projection's drift model reads them (tailspec/simulate/drift.py). None where not measured.
    policy_entropy: float | None = None
    policy_kl: float | None = None
    # sha256 of every response's token ids in request order: under rollout.verify_rule "coupled" the same in
    # every mode (no SD, frozen, co-trained) while the policies are the same, which pairs a bench's modes
    responses_digest: str = ""


def responses_digest(results: list[WorkResult]) -> str:
    """A digest of the step's responses, request by request (rid order), independent of which worker ran what."""
    h = hashlib.sha256()
    for o in sorted((o for res in results for o in res.outputs), key=lambda o: o.rid):
        h.update(f"{o.rid}:{','.join(map(str, o.token_ids))};".encode())
    return h.hexdigest()[:16]


def counters(r, cluster: str) -> dict[str, float]:
    raw = r.hgetall(state.key(cluster, "counters"))
    return {k.decode(): float(v) for k, v in raw.items()}


def current_drafter(r, cluster: str) -> DrafterVersion | None:
    """The promoted drafter version (drafter:current), or None before the first promotion."""
    return state.get(r, state.key(cluster, "drafter_current"), DrafterVersion)


@dataclass
class Instruments:
    """What a step measures outside its time (`Demo.instrument`): the logprob check, the policy's drift, and at
    measured steps both drafters' acceptance."""

    lp_diff: float
    policy_entropy: float | None = None
    policy_kl: float | None = None
    acc_frozen: float | None = None
    acc_co: float | None = None


@dataclass
class StepTimes:
    """Wall-clock marks of one step (time.time()) and the spans measured inside it."""

    start: float
    train: float  # rollout done, grading starts
    end: float
    rollout_s: float
    measure_s: float
    wait_sessions_s: float
    phase_lag_s: float = 0.0  # the last worker's result → the trainer changes the phase


def step_row(step: int, mode: str, t: StepTimes, results: list[WorkResult], before: dict[str, float],
             after: dict[str, float], *, drafter_version: int | None, acc_frozen: float | None,
             acc_co: float | None, mean_reward: float, correct: list[bool], policy_version: int,
             lp_diff: float, styles: list[str | None] | None = None, policy_entropy: float | None = None,
             policy_kl: float | None = None) -> StepRow:
    """One step's figures from the workers' results and the scheduler's counters before and after it."""
    outs = [o for res in results for o in res.outputs]
    last_done = max(r.finished_at for r in results)
    tail_idle = sum(last_done - r.finished_at for r in results)
    fwd = sum(o.target_forwards for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    mix: dict[str, int] = {}
    by_k: dict[str, list[int]] = {}
    for res in results:
        for k, v in res.strategy_mix.items():
            mix[k] = mix.get(k, 0) + v
        for k, (rows, acc) in res.accepted_by_k.items():
            cell = by_k.setdefault(k, [0, 0])
            cell[0] += rows
            cell[1] += acc
    return StepRow(
        step=step, mode=mode, step_time_s=t.end - t.start - t.measure_s, rollout_time_s=t.rollout_s,
        train_time_s=t.end - t.train - t.measure_s, measure_s=t.measure_s, wait_sessions_s=t.wait_sessions_s,
        idle_gpu_seconds=after.get("idle_gpu_seconds", 0) - before.get("idle_gpu_seconds", 0),
        lent_gpu_seconds=after.get("lent_gpu_seconds", 0) - before.get("lent_gpu_seconds", 0),
        session_seconds={short: after.get(name, 0) - before.get(name, 0) for short, name in SESSION_SECONDS.items()},
        drafter_version=drafter_version,
        acceptance_length=tokens / max(fwd, 1), acceptance_frozen=acc_frozen, acceptance_cotrained=acc_co,
        tokens=tokens, rollout_tokens_per_s=tokens / max(t.rollout_s, 1e-9), mean_reward=mean_reward,
        accuracy=float(np.mean(correct)), policy_version=policy_version, logprob_max_abs_diff=lp_diff,
        sessions=int(after.get("sessions_started", 0) - before.get("sessions_started", 0)),
        t_start=t.start, t_end=t.end,
        tail_idle_gpu_seconds=tail_idle, tail_idle_share=tail_idle / max(len(results) * t.rollout_s, 1e-9),
        worker_busy_s={r.worker: r.finished_at - r.started_at for r in results}, strategy_mix=mix,
        worker_lengths={r.worker: [len(o.token_ids) for o in r.outputs] for r in results},
        worker_setup_s={r.worker: r.setup_s for r in results},
        worker_decode_s={r.worker: r.decode_s for r in results}, accepted_by_k=by_k,
        worker_cost={r.worker: r.cost_model for r in results if r.cost_model is not None},
        phase_lag_s=t.phase_lag_s,
        worker_drain_lead_s={r.worker: r.finished_at - r.drained_at for r in results if r.drained_at is not None},
        worker_finished_at={r.worker: r.finished_at for r in results},
        alt_style_share=float(np.mean([s == ALT for s in styles])) if styles else 0.0,
        policy_entropy=policy_entropy, policy_kl=policy_kl,
        responses_digest=responses_digest(results),
    )


def measure_acceptance(model, frozen_path: str, current: DrafterVersion | None, samples: list[Sample],
                       n: int, k: int, policy_version: int) -> tuple[float, float]:
    """Expected acceptance length at k of the frozen first drafter and of `current` (the promoted co-trained
    version; None or the bootstrap drafter: the frozen one's figure), on up to n of this step's own samples
    with the current policy as teacher (the same samples for both)."""
    held = samples[:: max(1, len(samples) // n)][:n]
    emb = model.get_input_embeddings()
    where = str(emb.weight.device)  # the policy's device: the RL trainer's (the CPU, or the CUDA device it trains on)
    frozen = Eagle3Module.load(frozen_path, emb, map_location=where)
    teacher = Teacher(model, frozen.config.aux_layer_ids, policy_version=policy_version)
    a_frozen = validate(frozen, teacher, held, k).acceptance_length
    if current is None or current.session_id == BOOTSTRAP_SESSION:  # the same weights, the same figure
        return a_frozen, a_frozen
    co = Eagle3Module.load(current.path, emb, map_location=where)
    return a_frozen, validate(co, teacher, held, k).acceptance_length


def record_health(r, cluster: str, current: DrafterVersion | None, step: int, policy_version: int,
                  acc_frozen: float, acc_co: float, n: int) -> None:
    """Staleness after each RL step: the drafter the workers ran (`current`; None: the frozen first drafter),
    on this step's own samples, beside its validated value at promotion (history:drafter_health)."""
    h = state.DrafterHealth(
        drafter_version=current.version if current is not None else 0, policy_version=policy_version, step=step,
        acceptance_length=acc_co if current is not None else acc_frozen,
        at_promotion=current.acceptance_length if current is not None else None,
        samples=n, source="rl_loop")
    try:
        state.append(r, state.key(cluster, "drafter_health"), h, maxlen=10_000)
    except Exception as e:  # a view; the RL step is done
        log.warning("drafter health not recorded: %s", e)


def publish_rollout_stats(r, cluster: str, row: StepRow) -> None:
    stats = state.RolloutStats(
        worker="all", step=row.step, tokens=row.tokens, seconds=row.rollout_time_s,
        target_forwards=int(row.tokens / max(row.acceptance_length, 1e-9)),
        drafted=0, accepted=0, acceptance_length=row.acceptance_length, strategy_mix=row.strategy_mix,
        drafter_version=row.drafter_version, ts=time.time())
    try:
        state.append(r, state.key(cluster, "rollout_stats"), stats)
    except Exception as e:  # a view; the RL step is done
        log.warning("rollout stats not published: %s", e)


def count_promotions(r, cluster: str) -> int:
    """Co-trained versions promoted during the run (the bootstrap drafter, version 1, is not one)."""
    key = state.key(cluster, "drafter_versions")
    versions = [state.decode(DrafterVersion, raw, where=key) for raw in r.lrange(key, 0, -1)]
    return sum(1 for v in versions if v.promoted and v.session_id != BOOTSTRAP_SESSION)
