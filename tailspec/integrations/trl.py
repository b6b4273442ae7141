"""tailspec attached to TRL's `GRPOTrainer` (the `trl` extra, pinned in pyproject.toml).

    from tailspec.integrations.trl import TailspecAttach, TailspecGRPOTrainer
    attach = TailspecAttach.connect("redis://sched:6379/0", cluster="run7", policy_root="/shared/run7/policy")
    trainer = TailspecGRPOTrainer(model=..., reward_funcs=..., args=grpo_config, train_dataset=...,
                                  processing_class=tok, tailspec=attach)
    trainer.train()

What it does, per RL step (one generation batch), on every rank unless said otherwise:
- generation start: the main process sets phase "rollout" with the policy version (`state.global_step`, the
  optimizer steps behind the weights that generate) and that version's directory; a `FinishedCounter` on the
  generating model reports this rank's progress (worker `<node>-rank<r>`, its GPU) at every decoding step;
- generation end: the rank reports its memory released (the `generate` KV cache is gone; on CUDA the allocator's
  cache is emptied first) and the free memory it measured, then waits for the other ranks at TRL's gather: the
  window in which tailspec lends its GPU;
- rewards: every rank has finished generating when TRL scores (TRL gathers before it), so the main process sets
  phase "train" and every rank waits in `wait_reclaimed` until every lent GPU is back, before the reward
  functions, the loss and the optimizer step use the GPUs; then each rank submits its own samples with TRL's
  rewards (weighted sum over reward functions, as TRL's advantages use) and the policy version that generated
  them;
- after each optimizer step (`on_step_end`) the main process publishes the new policy as a whole directory
  (`PolicyPublisher`: temp dir, fsync, rename) for the sessions' teacher: the weights are copied to host memory on
  the trainer's thread and written on a background thread (one publish at a time), so the next generation does not
  wait for the disk; the phase names the newest version written whole, and the run's end waits for the last.

Subclass plus callback, no fork and nothing replaced at run time: the subclass wraps two GRPOTrainer methods
(`_generate_single_turn`, `_calculate_rewards`; TRL has no callback between generation and scoring), calls the
originals unchanged, and reads nothing from the RNG, so an attached run trains exactly as an unattached one with
the same seed (tests/test_integration_trl.py compares the loss curves). Where TRL generates with vLLM the hook
sees no decoding step: progress is reported at generation start and end only.

With vLLM (`use_vllm=True`, colocate mode) and `drafter_path` given, TRL's engine speculates with tailspec's
EAGLE-3 drafter, loads each promoted version between two generation calls and runs the health guard on its
counters (tailspec.integrations.trl_vllm: how the engine's arguments get in, and the weight sync vLLM's CPU build
needs).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from tailspec.integrations.framework import BatchWatch, follow_promotions
from tailspec.integrations.policy import PolicyPublisher
from tailspec.integrations.progress import FinishedCounter
from tailspec.integrations.trl_vllm import TrlVllm, cpu_weight_sync, engine_arguments
from tailspec.rollout.health_guard import GuardPolicy
from tailspec.rollout.vllm_live import LiveVllm
from tailspec.scheduler.client import ReclaimWait, TailspecClient

log = logging.getLogger(__name__)


@dataclass
class AttachStats:
    """What the attachment did, for tests, benches and logs (wall-clock times, time.time())."""

    waits: list[dict] = field(default_factory=list)  # step, waited_s, reclaimed, held, returned_at
    optimizer_steps: list[float] = field(default_factory=list)  # when each optimizer step was about to run
    samples: int = 0
    samples_dropped: int = 0  # refused by the client (queue full) or with a NaN reward
    published: list[int] = field(default_factory=list)  # policy versions this process published
    progress_reports: int = 0
    verdicts: list[dict] = field(default_factory=list)  # the health guard's, with TRL's vLLM engine
    # seconds the attachment took on the trainer's thread, by cause: "publish" (the policy's save), "phase"
    # (set_phase), "progress" (the decoding hook and the reports), "wait_reclaimed", "submit" (samples), "flush"
    seconds: dict[str, float] = field(default_factory=dict)

    def timed(self, cause: str, t0: float) -> None:
        """Add the time since `t0` (time.perf_counter()) to `cause`."""
        self.seconds[cause] = self.seconds.get(cause, 0.0) + time.perf_counter() - t0

    def to_dict(self) -> dict:
        return {"waits": self.waits, "optimizer_steps": self.optimizer_steps, "samples": self.samples,
                "samples_dropped": self.samples_dropped, "published": self.published,
                "progress_reports": self.progress_reports, "verdicts": self.verdicts, "seconds": self.seconds}


class TailspecAttach:
    """The tailspec side of one trainer process: the client, where policies are published, and this rank's
    worker name and GPUs (filled in by the trainer from accelerate's ranks unless given)."""

    def __init__(self, client: TailspecClient, policy_root: str | Path, *, worker: str | None = None,
                 gpus: list[int] | None = None, reclaim_timeout_s: float = 30.0, publish_every: int = 1,
                 keep_policies: int = 3, release_memory: bool = True, report_every_s: float = 0.25,
                 drafter_path: str | Path | None = None, drafter_version: int | None = None, drafter_k: int = 4,
                 guard: GuardPolicy | None = GuardPolicy()):
        # report_every_s: how often the decoding hook reports progress (each report wakes the client's writer, a few
        # hundred µs of the rank's CPU); the drain that lends the GPU is reported at the generation's end regardless.
        # drafter_*: with `use_vllm` (colocate), TRL's engine speculates with this EAGLE-3 export (lineage version
        # `drafter_version`, if it is one) and follows the promoted versions; `guard`: the health guard (None: off)
        if publish_every < 1:
            raise ValueError(f"publish_every must be >= 1, got {publish_every}")
        if reclaim_timeout_s <= 0:
            raise ValueError(f"reclaim_timeout_s must be > 0, got {reclaim_timeout_s}")
        self.client = client
        self.publisher = PolicyPublisher(policy_root, keep=keep_policies)
        self.worker, self.gpus = worker, gpus
        self.reclaim_timeout_s, self.publish_every = reclaim_timeout_s, publish_every
        self.release_memory, self.report_every_s = release_memory, report_every_s
        self.drafter_path, self.drafter_version, self.drafter_k = drafter_path, drafter_version, drafter_k
        self.guard = guard
        self.stats = AttachStats()

    @classmethod
    def connect(cls, redis_url: str, cluster: str, policy_root: str | Path, node: str | None = None,
                **kw: Any) -> TailspecAttach:
        """`node` must be the name this node's GPU telemetry is published under: `cluster.node` of the
        single-node scheduler, `ray_node_name()` under Ray attach. Default: $TAILSPEC_NODE, else the tailspec
        config's `cluster.node`."""
        if node is None:
            # deferred: only without an explicit node or $TAILSPEC_NODE
            from tailspec.core.config import load_config

            node = os.environ.get("TAILSPEC_NODE") or load_config().cluster.node
        return cls(TailspecClient(redis_url, cluster=cluster, node=node), policy_root, **kw)

    def close(self) -> None:
        self.client.close(flush_s=2.0)


class _TailspecCallback(TrainerCallback):
    """Publishes the policy after optimizer steps and records when they happen; phase idle at the end."""

    def __init__(self, trainer: TailspecGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kw):
        self.trainer._publish_policy(state.global_step)
        self.trainer._published_whole()  # the first rollout's phase names a policy: the sessions need a teacher

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.trainer.tailspec.stats.optimizer_steps.append(time.time())

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % self.trainer.tailspec.publish_every == 0:
            self.trainer._publish_policy(state.global_step)

    def on_train_end(self, args, state, control, **kw):
        ts = self.trainer.tailspec
        t0 = time.perf_counter()
        self.trainer._published_whole()
        if self.trainer.accelerator.is_main_process:
            ts.client.set_phase("idle", state.global_step, policy_version=state.global_step)
        ts.client.flush(2.0)
        ts.stats.timed("flush", t0)


class TailspecGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` with tailspec attached (see the module doc). Every argument but `tailspec` is TRL's."""

    def __init__(self, *args: Any, tailspec: TailspecAttach, **kwargs: Any):
        grpo = kwargs.get("args", args[2] if len(args) > 2 else None)
        speculate = tailspec.drafter_path is not None and bool(getattr(grpo, "use_vllm", False))
        with engine_arguments(tailspec.drafter_path, tailspec.drafter_k) if speculate else nullcontext():
            super().__init__(*args, **kwargs)
        self.tailspec = tailspec
        self.live: LiveVllm | None = None
        self._watch: BatchWatch | None = None
        acc = self.accelerator
        if tailspec.worker is None:
            tailspec.worker = f"{tailspec.client.node}-rank{acc.process_index}"
        if tailspec.gpus is None:
            tailspec.gpus = [acc.local_process_index]
        tok = self._tokenizer
        self._stop_ids = [*self.eos_token_ids] + ([tok.pad_token_id] if tok.pad_token_id is not None else [])
        self._rollout_version: int | None = None
        self._rollout_prompt_ids: list[list[int]] | None = None
        self._publishing: threading.Thread | None = None  # the policy publish in flight (main process)
        self.add_callback(_TailspecCallback(self))
        if speculate:
            self._attach_engine()

    def _attach_engine(self) -> None:
        """The promotion watcher and the guard over TRL's colocated engine (tailspec.integrations.trl_vllm)."""
        ts, gen = self.tailspec, self.vllm_generation
        cpu_weight_sync(gen)
        name = f"{ts.worker}-vllm"  # the worker name of its guard verdicts
        target = TrlVllm(lambda: gen.llm, self.model.name_or_path, ts.drafter_path, ts.drafter_k,
                         max_num_seqs=int(getattr(self.args, "vllm_max_num_seqs", None) or 256), name=name)
        c = ts.client
        self.live = follow_promotions(target, c, c.cluster, ts.drafter_version, worker=name, guard=ts.guard)
        self._watch = BatchWatch(self.live, target, synced=self.state.global_step)

    # -- policy -------------------------------------------------------------------------------------
    def _publish_policy(self, version: int) -> None:
        """Publish `version` (the module doc): the weights copied to the host here, written on a background thread
        once the previous publish is done."""
        if not self.accelerator.is_main_process:
            return
        t0 = time.perf_counter()
        self._published_whole()  # one at a time: in order, and at most one copy of the weights held
        model = self.accelerator.unwrap_model(self.model)
        weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
            self.processing_class.save_pretrained(tmp)

        def run() -> None:
            try:
                self.tailspec.publisher.publish(version, write)
                self.tailspec.stats.published.append(version)
            except Exception as e:  # noqa: BLE001 - the sessions keep the previous version's teacher
                log.warning("tailspec: policy version %d not published: %s", version, e)

        self._publishing = threading.Thread(target=run, name=f"tailspec-publish-v{version}", daemon=True)
        self._publishing.start()
        self.tailspec.stats.timed("publish", t0)

    def _published_whole(self) -> None:
        """Wait for the publish in flight, if any."""
        if self._publishing is not None:
            self._publishing.join()
            self._publishing = None

    # -- generation ---------------------------------------------------------------------------------
    def _report(self, active: int, finished: int, total: int, **kw: Any) -> None:
        ts = self.tailspec
        ts.client.report_progress(ts.worker, ts.gpus, active=active, finished=finished, total=total,
                                  step=self._rollout_version or 0, phase="rollout", **kw)
        ts.stats.progress_reports += 1

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not self.model.training:  # evaluation generates too; that is no rollout phase
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        ts = self.tailspec
        version = self.state.global_step
        self._rollout_version, self._rollout_prompt_ids = version, [list(p) for p in prompt_ids]
        if self.accelerator.is_main_process:
            t0 = time.perf_counter()
            latest = ts.publisher.latest()
            path = str(latest[1]) if latest is not None else None
            ts.client.set_phase("rollout", version, policy_version=latest[0] if latest else version,
                                policy_path=path)
            ts.stats.timed("phase", t0)
        t0 = time.perf_counter()
        self._report(len(prompt_ids), 0, len(prompt_ids), mem_released=False)
        ts.stats.timed("progress", t0)
        counter = FinishedCounter(lambda a, f, t: self._report(a, f, t, mem_released=False), self._stop_ids,
                                  every_s=ts.report_every_s)
        if self._watch is not None:
            # between two generation calls; TRL syncs the weights of the optimizer steps since the last one next
            self._watch.before(self.state.global_step)
        with counter.attach(self.accelerator.unwrap_model(self.model)):
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                has_tool_images)
        ts.stats.seconds["progress"] = ts.stats.seconds.get("progress", 0.0) + counter.seconds
        if self._watch is not None:
            ts.stats.verdicts += self._watch.after()
        t0 = time.perf_counter()
        free = None
        if torch.cuda.is_available() and ts.release_memory:
            torch.cuda.empty_cache()
            free = int(torch.cuda.mem_get_info()[0])
        n = len(prompt_ids)
        self._report(0, n, n, mem_released=ts.release_memory, free_mem=free)
        ts.stats.timed("progress", t0)
        return out

    # -- scoring: every rank finished generating (TRL gathered lengths in _generate) ------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if not self.model.training:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        ts = self.tailspec
        version = self._rollout_version if self._rollout_version is not None else self.state.global_step
        t0 = time.perf_counter()
        if self.accelerator.is_main_process:
            ts.client.set_phase("train", version, policy_version=version)
        ts.stats.timed("phase", t0)
        t0 = time.perf_counter()
        w: ReclaimWait = ts.client.wait_reclaimed(timeout_s=ts.reclaim_timeout_s)
        ts.stats.timed("wait_reclaimed", t0)
        ts.stats.waits.append({"step": version, "waited_s": w.waited_s, "reclaimed": w.reclaimed,
                               "held": list(w.held), "error": w.error, "returned_at": time.time()})
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        t0 = time.perf_counter()
        self._submit(rewards_per_func, completion_ids_list, version)
        ts.stats.timed("submit", t0)
        return rewards_per_func

    def _submit(self, rewards_per_func: torch.Tensor, completion_ids: list, version: int) -> None:
        ts = self.tailspec
        prompt_ids = self._rollout_prompt_ids or []
        n = len(completion_ids)
        if len(prompt_ids) != n:  # e.g. tool-call turns changed the batch: nothing to pair safely
            log.warning("tailspec: %d prompts for %d completions; samples of step %d not submitted",
                        len(prompt_ids), n, version)
            return
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        all_nan = torch.isnan(rewards_per_func).all(dim=1)
        start = self.accelerator.process_index * n  # TRL's process_slice: this rank's rows of the gathered batch
        samples = []
        for i in range(n):
            if bool(all_nan[start + i]):
                ts.stats.samples_dropped += 1
                continue
            samples.append({"prompt_ids": prompt_ids[i], "response_ids": list(completion_ids[i]),
                            "reward": float(rewards[start + i]), "policy_version": version})
        accepted = ts.client.submit_samples(samples) if samples else 0
        ts.stats.samples += accepted
        ts.stats.samples_dropped += len(samples) - accepted
