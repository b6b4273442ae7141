"""A preemptible training session: start from the lineage head (or the latest checkpoint), train on the
buffer until told to stop, merge (or save) atomically, free memory.

With a `Lineage` (lineage.py, the cluster path) the session pulls the head, merges its work into it
every `merge_every_steps` and when it stops, and continues from the merged head; its durable state is
the lineage, not a checkpoint of its own. With `trainer.merge_rule = rounds` (the default; with Redis and the
torch backend) each optimizer step is instead a synchronous round over every member's gradient, exchanged over a
collective (rounds.py), joined at each run and left at each stop. Without one it resumes from and saves to `checkpoint_dir`
(standalone use).

Stopping. `should_continue()` (a local read of the session's lease flag, which the session process's renewal
thread and the scheduler's pushed revocation set: scheduler/lease_keeper.py) and `request_stop()` (thread-safe: a
signal handler, another thread) are checked at every check point: between steps, before each of the teacher's
decoder layers, after the teacher, between unroll steps, at each unroll step of the backward pass (torch backend),
between micro-batches, after backward, and before each layer and batch of a validation. `should_continue()` must therefore be cheap (no round trip). A lease that is gone
raises `Preempted`, a requested stop `StopRequested` (its base); the micro-batch in flight is then abandoned. A step is `trainer.micro_batch_size`
micro-batches whose gradients accumulate (formed from the batch sorted by length, so a micro-batch pads
little, and run in random order): when a stop comes after at least one of them, the optimizer steps on the
per-token mean gradient of the micro-batches done at lr × their share of the batch's tokens — a smaller
batch's step, so a lend shorter than a step still trains (with micro_batch_size 0, the whole batch at once,
the step in flight is abandoned). Both halves matter: in lends of a second or two a third of the steps are
cut short, and a clipped Adam step does not shrink with its batch, so at the full lr a cut step on the two
shortest responses would count as much as a whole step. Then the state as of the last step is saved
(drafter + optimizer + counters, see checkpoint.py) and the session returns. The stop latency (request →
checkpoint whole and memory freed) is recorded.

Giving the GPU back before the last merge. When the lend is over (any stop but a `max_seconds` chunk's end) and
`on_release` is given, what the last merge needs (the weights, their base, AdamW's moments) is moved to the host,
the device memory is freed (the teacher's module too), and `on_release()` says so, before the merge: writing a
real drafter's head (weights and moments, gigabytes, fsynced to a shared filesystem) takes seconds, the copy to
the host a fraction of that, and the GPU is not needed for it. On the CPU (simulated GPUs) there is nothing to
move, and the merge's host work runs on the simulated GPU's cores, which the trainer's update now uses: there it
runs on its own thread at niceness `host_nice` (set where the session is pinned to a simulated GPU's cores), so it
takes only the CPU the update leaves, as a GPU node's host work takes none of the GPU's compute. Niceness is a
thread's own on Linux and cannot be lowered back without privileges; the thread ends with the merge, so the
process's next lend trains at its own priority.

Backends (backends.py): `torch` (AdamW); `deepspeed` (ZeRO-2, optimizer offload to CPU, deepspeed_backend.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tailspec.core.config import TrainerConfig
from tailspec.core.niceness import at_niceness
from tailspec.drafter_trainer.backends import make_backend
from tailspec.drafter_trainer.checkpoint import load_latest, save_checkpoint
from tailspec.drafter_trainer.lineage import DUPLICATE, FENCED, Lineage, MergeResult, copy_trainable, snapshot
from tailspec.drafter_trainer.loss import StopRequested, step_token_counts, ttt_loss
from tailspec.drafter_trainer.rollout_targets import load_targets
from tailspec.drafter_trainer.rounds import Rounds
from tailspec.drafter_trainer.samples import SampleBuffer, SampleReader
from tailspec.drafter_trainer.teacher import Teacher, collate, new_drafter

log = logging.getLogger(__name__)


@dataclass
class SessionResult:
    session_id: str
    steps: int  # optimizer steps in this session
    total_steps: int  # including earlier sessions (resumed from the checkpoint)
    tokens: int
    losses: list[float]
    stop_reason: str
    stop_latency_s: float | None
    checkpoint: Path | None
    seconds: float
    train_seconds: float  # time inside whole steps (teacher + drafter + optimizer)
    step_accuracy: list[float] = field(default_factory=list)
    merged_steps: int = 0  # optimizer steps this session merged into the lineage head
    merges: int = 0
    head: int | None = None  # lineage head number after the session's last merge
    shipped_batches: int = 0  # (micro-)batches trained on the rollout's shipped targets, not the teacher's forward

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds > 0 else 0.0


class Preempted(StopRequested):
    """Raised at a check point once `should_continue()` is False: the session's GPU was taken back. The unit of
    work in flight (a layer's forward, a micro-batch, a validation batch) is abandoned; the session stops as on any
    stop (the module doc)."""


class TrainingSession:
    def __init__(self, cfg: TrainerConfig, teacher: Teacher, buffer: SampleBuffer, *,
                 checkpoint_dir: str | Path | None = None,
                 should_continue: Callable[[], bool] | None = None,
                 on_step: Callable[[int, float, int], object] | None = None,
                 reader: SampleReader | None = None, checkpoint_every_steps: int | None = None,
                 poll_every_steps: int = 10, report_every_s: float = 0.25, session_id: str | None = None,
                 lineage: Lineage | None = None, merge_every_steps: int | None = None,
                 on_release: Callable[[], object] | None = None, host_nice: int = 0):
        self.cfg = cfg
        self.teacher = teacher
        self.buffer = buffer
        self.reader = reader
        self.checkpoint_dir = Path(checkpoint_dir or cfg.checkpoint_dir)
        self.should_continue = should_continue or (lambda: True)
        self.on_step = on_step
        self.checkpoint_every_steps = checkpoint_every_steps
        self.poll_every_steps = poll_every_steps
        self.report_every_s = report_every_s
        self.session_id = session_id or uuid.uuid4().hex[:12]
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._stop_at: float | None = None
        self._preempted = False
        self.lineage = lineage
        # Synchronous rounds (rounds.py) where the config asks and the lineage has Redis and the backend is torch's;
        # else merges of deltas (lineage.py).
        use_rounds = (lineage is not None and lineage.redis is not None and cfg.merge_rule == "rounds"
                      and cfg.backend == "torch")
        self.rounds = Rounds(lineage, self.session_id, cfg, teacher.device) if use_rounds else None
        self.merge_every_steps = merge_every_steps
        self.host_nice = host_nice  # the niceness of the merge after release (the module doc: Giving the GPU back)
        self.merged_steps = self.merges = self._seq = 0
        self.partial_steps = 0  # steps cut short by a stop and taken on the micro-batches done
        self.shipped_batches = 0  # (micro-)batches whose targets the rollout shipped (rollout_targets.py)
        self.base = None  # the lineage head the local work started from
        self.fenced_out = False
        self.on_release = on_release
        self.released_after_s: float | None = None  # stop → device memory freed (the module doc: Giving the GPU back)
        self._host_optimizer: dict | None = None  # AdamW's state on the host once the device is released

        if lineage is not None:
            ck = self._pull_or_seed(reader)
        else:
            ck = load_latest(self.checkpoint_dir, teacher.embedding(), map_location=str(teacher.device))
        if ck is not None:
            self.drafter = ck.drafter
            self.drafter.check_fits(teacher.config)
            teacher.aux_layer_ids = self.drafter.config.aux_layer_ids
            self.step = ck.step if self.base is None else self.base.steps
            self.tokens_total = int(ck.trainer_state.get("tokens", 0)) if self.base is None else self.base.tokens
            self.resumed_from: Path | None = ck.path
        else:
            if reader is not None and not buffer.train:
                reader.poll()
            self.drafter = new_drafter(teacher, cfg, buffer)
            self.step, self.tokens_total, self.resumed_from = 0, 0, None
        self.drafter.train()
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.backend = make_backend(self.params, self.drafter, cfg)
        if ck is not None and ck.optimizer_state is not None and ck.trainer_state.get("backend", "torch") == self.backend.name:
            self.backend.load_state_dict(ck.optimizer_state)
        self.base_weights = snapshot(self.drafter)
        self._steps_since_merge = self._tokens_since_merge = 0

    def _pull_or_seed(self, reader: SampleReader | None):
        """The lineage head's checkpoint; a lineage without a head is seeded with a new drafter first (if
        another session seeded it meanwhile, that head is pulled: every session shares one vocab map)."""
        lin = self.lineage
        pulled = lin.pull(self.teacher.embedding(), map_location=str(self.teacher.device))
        if pulled is None:
            if reader is not None and not self.buffer.train:
                reader.poll()
            fresh = new_drafter(self.teacher, self.cfg, self.buffer)
            lin.seed(fresh.to("cpu"), {"step": 0, "tokens": 0, "backend": self.cfg.backend},
                     session_id=self.session_id)
            pulled = lin.pull(self.teacher.embedding(), map_location=str(self.teacher.device))
        self.base, ck = pulled
        lin.collect()
        return ck

    # -- stopping ------------------------------------------------------------------------------------
    def request_stop(self, reason: str = "requested") -> None:
        """Thread-safe; the session leaves at the next check point inside the current step."""
        if not self._stop.is_set():
            self._stop_reason, self._stop_at = reason, time.monotonic()
            self._stop.set()

    def _check(self) -> None:
        # Every check point reads should_continue() (a local flag): a lease revoked mid-step is noticed at the next
        # layer, not when the step ends — a step can outlast the deadline on a busy machine, and the trainer's
        # wait_reclaimed waits for the stop.
        if not self._stop.is_set() and not self.should_continue():
            self._preempted = True
            self.request_stop("should_continue")
        if self._stop.is_set():
            raise (Preempted if self._preempted else StopRequested)(self._stop_reason)

    def _backward_check(self) -> Callable[[], None] | None:
        """The check the backward pass runs at each unroll step (drafter_trainer/loss.py: unroll): the torch backend's
        only — DeepSpeed's engine keeps its own hooks on the backward, which an exception there would leave half
        run."""
        return self._check if self.backend.name == "torch" else None

    def check(self) -> None:
        """`_check` for work outside train_step (validation): cheap enough to run before every layer."""
        self._check()

    def check_continue(self) -> None:
        """The check between steps; raises Preempted or StopRequested."""
        self._check()

    # -- training ------------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, int, list[float]] | None:
        """One optimizer step on a batch from the buffer → (loss, tokens, per-step accuracy); None if empty.
        A stop cuts a micro-batched step short (the module doc: Stopping): it returns the step taken on the
        micro-batches done, and the next stop check raises; nothing done raises StopRequested at once."""
        # Seeded by step (and rank, for data parallel): a resumed session draws the batches it would have.
        # Contributors to one lineage start from the same head step: their session id tells their draws apart.
        salt = zlib.crc32(self.session_id.encode()) if self.lineage is not None else 0
        rng = random.Random(((self.cfg.seed * 1_000_003 + self.step) * 1009 + getattr(self.backend, "rank", 0)) ^ salt)
        samples, w = self.buffer.batch(self.cfg.batch_size, rng)
        if not samples:
            return None
        micro = self.cfg.micro_batch_size if hasattr(self.backend, "accumulate") else 0
        if not micro or micro >= len(samples):
            return self._whole_step(collate(samples, w).to(self.teacher.device), samples)
        return self._micro_step(samples, w, micro, rng)

    def _targets(self, samples: list, batch):
        """The batch's aux states and logits: the rollout's shipped ones when every sample has them (and
        `trainer.target_source` is `rollout`), else the teacher's forward."""
        if self.cfg.target_source == "rollout":
            tcfg = self.teacher.config
            got = load_targets(samples, self.teacher.aux_layer_ids, batch.ids.shape[1],
                               next(self.teacher.model.parameters()).dtype, self.teacher.device,
                               dims=(len(self.teacher.aux_layer_ids) * tcfg.hidden_size, tcfg.vocab_size))
            if got is not None:
                self.shipped_batches += 1
                return got
        return self.teacher(batch, self._check)

    def _whole_step(self, batch, samples: list) -> tuple[float, int, list[float]]:
        out = self._targets(samples, batch)
        self._check()
        res = ttt_loss(self.drafter, out.aux, out.logits, batch.ids, batch.lengths, batch.prompt_lens,
                       batch.weights, self.cfg.ttt_length, self.cfg.step_decay, check=self._check,
                       backward_check=self._backward_check())
        self._check()
        if self.rounds is None:
            self.backend.step(res.loss, self._check)
            self._count_step(batch.tokens)
        else:
            self.backend.zero_grad()
            self.backend.accumulate(res.loss)
            self._check()
            self.rounds.step(self, 1.0, 1.0, batch.tokens)
        return float(res.loss.detach()), batch.tokens, res.step_accuracy

    def _micro_step(self, samples: list, weights: list[float], micro: int,
                    rng: random.Random) -> tuple[float, int, list[float]]:
        order = sorted(range(len(samples)), key=lambda j: len(samples[j].prompt_ids) + len(samples[j].response_ids))
        parts = [order[s : s + micro] for s in range(0, len(order), micro)]
        rng.shuffle(parts)  # micro-batches by length, in random order: a step cut short is a random part of the batch
        whole = collate(samples, weights)
        denominators = step_token_counts(whole.lengths, whole.prompt_lens, self.cfg.ttt_length)
        loss, tokens = 0.0, 0
        agree, done = [0.0] * self.cfg.ttt_length, [0.0] * self.cfg.ttt_length
        self.backend.zero_grad()
        in_backward = False
        for part in parts:
            batch = collate([samples[j] for j in part], [weights[j] for j in part]).to(self.teacher.device)
            try:
                out = self._targets([samples[j] for j in part], batch)
                self._check()
                res = ttt_loss(self.drafter, out.aux, out.logits, batch.ids, batch.lengths, batch.prompt_lens,
                               batch.weights, self.cfg.ttt_length, self.cfg.step_decay, check=self._check,
                               denominators=denominators, backward_check=self._backward_check())
                self._check()
                in_backward = True
                self.backend.accumulate(res.loss)
                in_backward = False
            except StopRequested:
                if tokens == 0 or in_backward:  # nothing done, or a backward cut short (its gradient partial):
                    self.backend.zero_grad()  # abandoned, as a whole step would be
                    raise
                self.partial_steps += 1
                break
            loss += float(res.loss.detach())
            tokens += batch.tokens
            counts = step_token_counts(batch.lengths, batch.prompt_lens, self.cfg.ttt_length)
            agree = [a + acc * c for a, acc, c in zip(agree, res.step_accuracy, counts)]
            done = [d + c for d, c in zip(done, counts)]
        scale = denominators[0] / max(1.0, done[0])  # 1 for a whole step
        if self.rounds is None:
            self.backend.apply(scale, lr_scale=1.0 / scale)
            self._count_step(tokens)
        else:  # the round's step: lr x the sum of its entries' shares
            self.rounds.step(self, scale, 1.0 / scale, tokens)
        return loss * scale, tokens, [a / max(1.0, d) for a, d in zip(agree, done)]

    def _count_step(self, tokens: int) -> None:
        self.step += 1
        self.tokens_total += tokens
        self._steps_since_merge += 1
        self._tokens_since_merge += tokens

    @property
    def unmerged_steps(self) -> int:
        return self._steps_since_merge

    def merge(self, final: bool = False) -> MergeResult | None:
        """Merge the steps since the last merge into the lineage head (one compare-and-swap), then
        continue from the merged head. None when there is nothing to merge. The merge writes this session's
        AdamW moments when `final` (the next session starts from them) and every `merge_moments_every`-th time;
        the others carry the head's (lineage.py: Optimizer state)."""
        if self.rounds is not None:  # rounds publish as they close; a stop leaves them and publishes the rest
            if final and not self.fenced_out:
                self.rounds.leave(self)
                self.rounds.publish(self)
                self.merged_steps = self.rounds.merged
            return None
        if self.lineage is None or self._steps_since_merge == 0 or self.fenced_out:
            return None
        self._seq += 1
        state = {"step": self.step, "tokens": self.tokens_total, "backend": self.backend.name,
                 "session_id": self.session_id, "policy_version": self.teacher.policy_version,
                 "saved_at": time.time()}
        opt = self._host_optimizer if self._host_optimizer is not None else self.backend.state_dict()
        res = self.lineage.merge(self.base, self.base_weights, self.drafter, opt, state,
                                 self.session_id, self._seq, self._steps_since_merge, self._tokens_since_merge,
                                 policy_version=self.teacher.policy_version,
                                 carry_moments=not final and self._seq % self.cfg.merge_moments_every != 0)
        if res.code == DUPLICATE:
            # This (session, seq) is in the head already: an earlier attempt's answer was lost on the way.
            # Continue from the head that holds it, or the next delta would carry these steps again.
            log.warning("session %s: merge %d was applied already", self.session_id, self._seq)
            self.merged_steps += res.steps
            self.merges += 1
            head, ck = self.lineage.pull(self.teacher.embedding(), map_location=str(self.drafter.fc.weight.device))
            copy_trainable(ck.drafter, self.drafter)
            self.base, self.base_weights, self.step = head, snapshot(self.drafter), head.steps
            self._steps_since_merge = self._tokens_since_merge = 0
        elif res.merged:
            self.merged_steps += res.steps
            self.merges += 1
            delayed = res.head.number != self.base.number + 1  # others merged meanwhile: our delta was delayed
            rule = self.cfg.merge_delayed_beta1
            if hasattr(self.backend, "set_beta1") and rule is not None:
                # Delay-aware momentum: the next chunk runs with trainer.merge_delayed_beta1 while others merge
                # between our merges, with trainer.beta1 otherwise (one contributor: never changed).
                self.backend.set_beta1(rule if delayed else self.cfg.beta1)
            if delayed:  # continue from the sum of everyone's work
                if self.backend.name != "torch":
                    # DeepSpeed keeps its own fp32 master weights: restart from the head instead of
                    # copying into the module under it.
                    self.request_stop("lineage head moved (deepspeed backend restarts from the head)")
                copy_trainable(res.weights, self.drafter)
            self.base = res.head
            self.base_weights = snapshot(self.drafter)
            self.step = res.head.steps  # the lineage's step count: what a resumed session would see
            self._steps_since_merge = self._tokens_since_merge = 0
        elif res.code == FENCED:
            # The GPU is no longer ours and no revocation covers us: the local work is discarded whole.
            self.fenced_out = True
            log.warning("session %s: merge refused (lease gone); %d local steps discarded", self.session_id,
                        self._steps_since_merge)
        return res

    def save(self) -> Path:
        if self.lineage is not None:
            self.merge(final=True)
            return Path(self.base.path)
        state = {"step": self.step, "tokens": self.tokens_total, "backend": self.backend.name,
                 "session_id": self.session_id, "policy_version": self.teacher.policy_version,
                 "saved_at": time.time()}
        return save_checkpoint(self.checkpoint_dir, self.drafter, self.backend.state_dict(), state)

    def run(self, max_steps: int | None = None, max_seconds: float | None = None) -> SessionResult:
        t0 = time.monotonic()
        losses: list[float] = []
        acc: list[float] = []
        steps = tokens = 0
        train_s = 0.0
        last_report = 0.0
        reason = "max_steps"
        try:
            if self.rounds is not None and not self.fenced_out:
                self.rounds.join(self)
            while True:
                if max_steps is not None and steps >= max_steps:
                    break
                if max_seconds is not None and time.monotonic() - t0 >= max_seconds:
                    reason = "max_seconds"
                    break
                self.check_continue()
                if self.reader is not None and (steps % self.poll_every_steps == 0 or not self.buffer.train):
                    try:
                        self.reader.poll()
                    except Exception as e:  # Redis hiccup: train on what the buffer has
                        log.warning("sample stream poll failed: %s", e)
                ts = time.monotonic()
                got = self.train_step()
                if got is None:
                    time.sleep(0.02)  # nothing to train on yet; keep checking the stop conditions
                    continue
                train_s += time.monotonic() - ts
                loss, n, acc = got
                losses.append(loss)
                steps += 1
                tokens += n
                if self.on_step is not None and (time.monotonic() - last_report >= self.report_every_s):
                    last_report = time.monotonic()
                    self.on_step(self.step, loss, self.tokens_total)
                if self.lineage is not None:
                    if self.rounds is None and self.merge_every_steps and self._steps_since_merge >= self.merge_every_steps:
                        self.merge()
                elif self.checkpoint_every_steps and self.step % self.checkpoint_every_steps == 0:
                    self.save()
        except StopRequested:
            reason = self._stop_reason or "requested"
        # Whatever ended the loop, the last whole step is saved before returning (the GPU given back first).
        self.drafter.zero_grad(set_to_none=True)
        if self.rounds is not None:  # the round holding our last entry applied before the device goes
            self.rounds.leave(self)
        released = self.on_release is not None and reason != "max_seconds"
        if released:
            self.release_device()
        if released and self.host_nice > 0:
            path = at_niceness(self.save, self.host_nice, "tailspec-host-merge")
        else:
            path = self.save()
        if self.on_step is not None and losses:
            self.on_step(self.step, losses[-1], self.tokens_total)
        latency = time.monotonic() - self._stop_at if self._stop_at is not None else None
        return SessionResult(self.session_id, steps, self.step, tokens, losses, reason, latency, path,
                             time.monotonic() - t0, train_s, acc, self.merged_steps, self.merges,
                             self.base.number if self.base is not None else None, self.shipped_batches)

    def release_device(self) -> None:
        """Move what the last merge needs to the host, free the device memory, then call `on_release` (the module
        doc: Giving the GPU back). The session trains no more after this; `save()` still merges."""
        on_device = self.drafter.fc.weight.device.type != "cpu"
        if on_device and self.backend.name != "torch":
            return  # DeepSpeed's engine keeps its master weights on the device: the GPU is back when the process ends
        if on_device:
            self._to_host()
        if self._stop_at is not None:
            self.released_after_s = time.monotonic() - self._stop_at
        if self.on_release is not None:
            self.on_release()

    def _to_host(self) -> None:
        """AdamW's state, the weights and their base to the host (the merge reads them there); the optimizer's and
        the teacher's device memory freed (the teacher's module to the meta device: it is not used again, and
        keep_teacher keeps host modules only)."""
        sd = self.backend.state_dict()
        self._host_optimizer = {
            "state": {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in st.items()} for i, st in sd["state"].items()},
            "param_groups": sd["param_groups"]}
        self.backend.close()
        self.drafter.to("cpu")
        self.base_weights = {n: w.cpu() for n, w in self.base_weights.items()}
        self.teacher.model.to("meta")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Free what the session holds (optimizer state, gradients, accelerator cache)."""
        self.backend.close()
        self.drafter.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
