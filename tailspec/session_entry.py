"""The session entry the scheduler runs on a lent GPU: `ENTRY` (`scheduler.session_entry`, default
`tailspec.session_entry:ENTRY`), the roof's one implementation of the scheduler's `SessionEntry` protocol
(scheduler/session_process.py).

`ENTRY.run(ctx)` (`run_session`) builds a drafter-training session from the cluster state: the teacher is the
latest policy (`phase.policy_path`), samples come from the cluster's sample stream, checkpoints and versions
live under `trainer.checkpoint_dir`. It trains while `ctx.should_continue()` (the lease flag) holds, reports
progress through `ctx.report(step, loss, tokens)`, and proposes candidates to the version store
(drafter_trainer/promotion.py decides which): first a head left to validate, then every
`trainer.validate_every_s` of training, right after the session's merge. Every session contributes to one
drafter lineage (drafter_trainer/lineage.py): it starts from the head, merges its work into it (fenced by its
lease) and proposes heads, not private copies.

`ENTRY.warm_up()` pays a warm process's first-use costs before its first lend; `ENTRY.prestage()` reads ahead
between lends what the next one starts from (tailspec/warm.py).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tailspec import warm
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import DrafterVersion, PhaseInfo
from tailspec.drafter_trainer.footprint import GIB, session_footprint
from tailspec.drafter_trainer.lineage import Fence, Lineage
from tailspec.drafter_trainer.promotion import Promotion
from tailspec.drafter_trainer.samples import SampleBuffer, SampleReader
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import SessionResult, TrainingSession
from tailspec.drafter_trainer.versions import VersionStore
from tailspec.mix_score import scoring_source
from tailspec.scheduler.placement import CPUS_ENV
from tailspec.scheduler.session_process import WARM_POLICY_ENV, SessionContext, SessionEntry
from tailspec.scheduler.telemetry import free_memory
from tailspec.warm import device_and_dtype, keep_teacher, load_teacher, remember

log = logging.getLogger(__name__)


class Contributor:
    """A TrainingSession (drafter_trainer/training_session.py: the optimizer steps) with what it needs to
    contribute to the cluster's one drafter lineage: the sample reader, the lineage under
    `trainer.checkpoint_dir/lineage`, the version store and its side of promotion (drafter_trainer/promotion.py:
    which head it proposes, when; under the rollouts' strategy mix, tailspec/mix_score.py). Used by run_session (a lent GPU) and `tailspec train` (the CLI)."""

    def __init__(self, cfg: TailspecConfig, teacher: Teacher, buffer: SampleBuffer, *, redis: Any = None,
                 should_continue: Callable[[], bool] | None = None,
                 on_step: Callable[[int, float, int], object] | None = None, session_id: str | None = None,
                 fence: Fence | None = None, on_release: Callable[[], object] | None = None):
        tc = cfg.trainer
        self.cfg = cfg
        self.teacher = teacher
        self.buffer = buffer
        self.redis = redis
        self.reader = None
        t0 = time.monotonic()
        if redis is not None:
            self.reader = SampleReader(redis, cfg.cluster.name, buffer, teacher.config.vocab_size, tc.max_seq_len,
                                       keep_versions=tc.keep_policy_versions)
            self.reader.poll()
        t1 = time.monotonic()
        self.root = Path(tc.checkpoint_dir)
        self.store = VersionStore(self.root / "versions", redis, cfg.cluster.name)
        self.lineage = Lineage(self.root / "lineage", redis, cfg.cluster.name, fence=fence, outer_lr=tc.merge_outer_lr)
        self.session = TrainingSession(
            tc, teacher, buffer, checkpoint_dir=self.root / "checkpoints", should_continue=should_continue,
            on_step=on_step, reader=self.reader, session_id=session_id, lineage=self.lineage,
            merge_every_steps=tc.merge_every_steps or None, on_release=on_release,
            # pinned to a simulated GPU's cores, which the trainer's update takes back: the merge after the release
            # is host work and takes only what the update leaves (drafter_trainer/training_session.py)
            host_nice=19 if os.environ.get(CPUS_ENV) else 0)
        # candidates are scored under the rollouts' published strategy mix (tailspec/mix_score.py)
        self.promotion = Promotion(tc, self.store, redis, cfg.cluster.name, self.root,
                                   scoring=scoring_source(redis, cfg.cluster.name) if redis is not None else None)
        self.ready_split = {"stream": t1 - t0, "lineage": time.monotonic() - t1}  # where start-up went

    @property
    def validate_s(self) -> float:
        """Time spent validating candidates (whole or cut short by a stop)."""
        return self.promotion.validate_s

    def propose(self) -> DrafterVersion | None:
        """Propose a lineage head to the version store, if one is due (drafter_trainer/promotion.py)."""
        return self.promotion.propose(self.session, self.teacher, list(self.buffer.holdout))

    def run(self, max_seconds: float | None = None, max_steps: int | None = None) -> SessionResult:
        every = self.cfg.trainer.validate_every_s
        self.propose()  # a head merged by a session that had no time left to validate it
        total: SessionResult | None = None
        while True:
            chunk = every if max_seconds is None else min(every, max(0.0, max_seconds - (total.seconds if total else 0)))
            left = None if max_steps is None else max_steps - (total.steps if total else 0)
            res = self.session.run(max_steps=left, max_seconds=chunk)  # ends with a merge
            total = res if total is None else _merge(total, res)
            if res.stop_reason != "max_seconds" or (max_seconds is not None and total.seconds >= max_seconds):
                break
            self.propose()
        return total

    def close(self) -> None:
        self.session.close()


def _merge(a: SessionResult, b: SessionResult) -> SessionResult:
    return SessionResult(b.session_id, a.steps + b.steps, b.total_steps, a.tokens + b.tokens, a.losses + b.losses,
                         b.stop_reason, b.stop_latency_s, b.checkpoint, a.seconds + b.seconds,
                         a.train_seconds + b.train_seconds, b.step_accuracy, b.merged_steps, b.merges, b.head,
                         a.shipped_batches + b.shipped_batches)


def make_buffer(cfg: TailspecConfig) -> SampleBuffer:
    tc = cfg.trainer
    return SampleBuffer(capacity=tc.buffer_size, keep_policy_versions=tc.keep_policy_versions,
                        holdout_fraction=tc.holdout_fraction, mode=tc.weighting, w_min=tc.weight_min, w_max=tc.weight_max,
                        stale_version_weight=tc.stale_version_weight)


def fits(ctx: Any, cfg: TailspecConfig, policy_path: str, dtype: torch.dtype) -> bool:
    """The memory handshake's last check, before anything is loaded: the footprint this session computes
    (teacher + drafter + gradients + optimizer + activations) against the GPU's free memory (NVML, or the
    simulation on simulated GPUs). When it does not fit the session declines: lease released, reason and
    figures in its record, nothing touched. Unknown free memory (no NVML, no telemetry) is not a reason to
    decline; the figure is recorded as absent."""
    need = session_footprint(policy_path, cfg.trainer, dtype)
    free, source = free_memory(ctx.redis, cfg.cluster.name, ctx.node, ctx.gpu,
                               simulated_mem=int(cfg.scheduler.simulated_gpu_mem_gib * GIB))
    ctx.mem_needed, ctx.mem_free = need.total, free
    if free is not None and need.total > free:
        ctx.decline(f"needs {need.describe()}, {free / GIB:.3f} GiB free ({source})", need.total, free)
        log.warning("session %s declined: %s", ctx.session_id, ctx.stop_reason)
        return False
    return True


# The cluster's counters a finished session adds its seconds to: lent GPU-seconds say only that a GPU was lent;
# these say how much of a lend trained (whole optimizer steps: teacher, drafter, optimizer), validated
# candidates, or went to start-up (the teacher's load, the stream's read, the lineage's pull).
# In synchronous rounds a step's time includes waiting for the round's other members (as a data-parallel step's
# includes its all-reduce): "wait" is that part of "train".
# "renew" is the CPU time of the session's lease renewal thread (scheduler/lease_keeper.py): off the step path, it
# still takes the session's cores beside its steps.
SESSION_SECONDS = {"ready": "session_ready_seconds", "train": "session_train_seconds",
                   "validate": "session_validate_seconds", "all": "session_seconds", "wait": "session_round_wait_seconds",
                   "renew": "session_renew_seconds"}


def record_seconds(redis: Any, cluster: str, *, ready: float, train: float, validate: float, total: float,
                   wait: float = 0.0, renew: float = 0.0) -> None:
    """Add a finished session's seconds to the cluster's counters (SESSION_SECONDS). Best effort: a lost count
    must not fail a session that trained."""
    try:
        p = redis.pipeline(transaction=False)
        for short, v in (("ready", ready), ("train", train), ("validate", validate), ("all", total), ("wait", wait),
                         ("renew", renew)):
            p.hincrbyfloat(state.key(cluster, "counters"), SESSION_SECONDS[short], max(0.0, float(v)))
        p.execute()
    except Exception as e:  # noqa: BLE001
        log.warning("session seconds not counted: %s", e)


def run_session(ctx: Any, max_steps: int | None = None) -> dict:
    """The session `ENTRY.run` runs: train on the lent GPU until `ctx.should_continue()` turns False (or
    `max_steps`)."""
    cfg: TailspecConfig = ctx.tailspec_config()
    r = ctx.redis
    phase = state.get(r, state.key(cfg.cluster.name, "phase"), PhaseInfo)
    if phase is None or not phase.policy_path:
        raise ValueError("no policy to distil from: the cluster's phase record has no policy_path "
                         "(the RL framework reports it with the phase)")
    # Start-up (loading the teacher, reading the stream) can outlast a lease TTL: the renewal thread keeps the lease
    # meanwhile; leave early if the GPU was taken back.
    if not ctx.should_continue():
        return {"steps": 0, "total_steps": 0, "tokens": 0, "stop_reason": "should_continue", "stop_latency_s": 0.0}
    remember(ctx)
    t_start = time.monotonic()
    device, dtype = device_and_dtype()
    if not fits(ctx, cfg, phase.policy_path, dtype):
        return {"steps": 0, "total_steps": 0, "tokens": 0, "stop_reason": ctx.stop_reason, "stop_latency_s": 0.0}
    t_fit = time.monotonic()
    teacher = load_teacher(phase.policy_path, device, dtype, phase.policy_version)
    t_teacher = time.monotonic()
    if not ctx.should_continue():
        return {"steps": 0, "total_steps": 0, "tokens": 0, "stop_reason": "should_continue", "stop_latency_s": 0.0}
    trainer = Contributor(cfg, teacher, make_buffer(cfg), redis=r, should_continue=ctx.should_continue,
                      on_step=lambda step, loss, tokens: ctx.report(step, loss, tokens),
                      session_id=ctx.session_id, fence=Fence(ctx.node, ctx.gpu, ctx.lease_token),
                      on_release=ctx.release)
    t_ready = time.monotonic()
    try:
        res = trainer.run(max_steps=max_steps)
        # One line per session in its log: where a lend's seconds went.
        split = {"fit": t_fit - t_start, "teacher": t_teacher - t_fit, **trainer.ready_split}
        print(f"tailspec session {ctx.session_id}: ready in {t_ready - t_start:.2f} s ("
              + ", ".join(f"{k} {v:.3f}" for k, v in split.items()) + f"), {res.steps} steps "
              f"({trainer.session.partial_steps} cut short; {res.shipped_batches} batches on shipped targets) in "
              f"{res.train_seconds:.2f} s, {res.merges} merges, "
              f"validating {trainer.validate_s:.2f} s, {time.monotonic() - t_start:.2f} s in all; stop: {res.stop_reason}"
              + (f", rounds: {rounds.rounds} applied, {rounds.late} entries late, {rounds.failed} failed, "
                 f"{rounds.waited_s:.2f} s waiting, {rounds.exchange_s:.2f} s exchanging"
                 if (rounds := trainer.session.rounds) is not None else "")
              + (f", GPU released {trainer.session.released_after_s:.3f} s after"
                 if trainer.session.released_after_s is not None else "")
              + (f", saved {res.stop_latency_s:.3f} s after" if res.stop_latency_s is not None else "")
              + (f"; lease: {k.renewals} renewals, {k.cpu_s * 1e3:.1f} ms CPU on its thread"
                 + (", revocation pushed" if k.pushed else "")
                 + (f", seen {ctx.stop_seen_at - k.stopped_at:.3f} s after it arrived"
                    if k.stopped_at is not None and ctx.stop_seen_at is not None else "")
                 if (k := getattr(ctx, "keeper", None)) else ""),
              file=sys.stderr, flush=True)
        rounds = trainer.session.rounds
        keeper = getattr(ctx, "keeper", None)
        record_seconds(r, cfg.cluster.name, ready=t_ready - t_start, train=res.train_seconds,
                       validate=trainer.validate_s, total=time.monotonic() - t_start,
                       wait=rounds.waited_s if rounds is not None else 0.0,
                       renew=keeper.cpu_s if keeper is not None else 0.0)
    finally:
        trainer.close()
        keep_teacher(teacher)
        del teacher, trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"steps": res.steps, "total_steps": res.total_steps, "tokens": res.tokens,
            "stop_reason": res.stop_reason, "stop_latency_s": res.stop_latency_s,
            "merged_steps": res.merged_steps, "merges": res.merges, "head": res.head,
            "shipped_batches": res.shipped_batches}


class DrafterTrainingEntry(SessionEntry):
    """The scheduler's session entry for drafter training (the module doc)."""

    def run(self, ctx: SessionContext) -> dict:
        return run_session(ctx)

    def warm_up(self) -> None:
        """Once in a pre-started session process (scheduler.warm_sessions): the first `from_pretrained` in a
        process pays seconds of lazy imports and set-up, which would otherwise come out of the lent GPU's time."""
        cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
        with tempfile.TemporaryDirectory(prefix="tailspec-warm-") as tmp:
            AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
            AutoModelForCausalLM.from_pretrained(tmp)
        # scheduler.warm_policy: build the policy's modules now, as the teacher a session keeps (keep_teacher), so
        # this process's first session loads only its weights. Only where the teacher lives on the host: a GPU's
        # teacher is never kept.
        policy = os.environ.get(WARM_POLICY_ENV)
        device, dtype = device_and_dtype()
        if policy and device == "cpu":
            try:
                keep_teacher(load_teacher(policy, device, dtype, 0))
            except (OSError, ValueError, RuntimeError) as e:  # a bad hint costs the first session its build, no more
                log.warning("warm policy %s not built: %s", policy, e)

    def prestage(self) -> None:
        """Between lends: the newest policy into the kept teacher, the lineage head staged (tailspec/warm.py)."""
        warm.prestage()


ENTRY = DrafterTrainingEntry()
