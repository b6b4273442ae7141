"""The demo's driver: a real GRPO loop on the tiny policy whose rollouts run on N simulated GPUs, with
tailspec attached exactly as it would be to verl or NeMo-RL — through the client calls only.

Once, before step 0: every worker warms its engine up (loads the policy and drafter, times the cost
model), as a real engine does when it starts; no step's time includes it.

Per RL step:
  set_phase(rollout) → work to every worker → workers decode, report progress, drain one by one
  → the scheduler lends drained GPUs to drafter-training sessions while the tail runs
  → last worker done: set_phase(train) → leases revoked, sessions stop
  → grade, GRPO update, submit samples (ids, reward, policy version; co-trained: their targets' file), publish
    policy version N+1
  → workers load the newest promoted drafter at the next phase start.

Three modes share every seed: `cotrained` (the above), `frozen` (the first drafter forever, no lending) and
`nospec` (plain decoding, no lending), all with the scheduler watching, so idle GPU-seconds count alike.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import DrafterVersion, Sample
from tailspec.demo.bootstrap import bootstrap_drafter, seed_store
from tailspec.demo.export import export_run_drafter
from tailspec.demo.measure import (
    Instruments,
    StepRow,
    StepTimes,
    count_promotions,
    counters,
    current_drafter,
    measure_acceptance,
    publish_rollout_stats,
    record_health,
    step_row,
)
from tailspec.demo.options import DEMO_SESSION_STARTUP_S, DemoOptions, apply_demo_trainer
from tailspec.demo.protocol import WorkItem, WorkRequest, WorkResult, results_key, work_key
from tailspec.demo.report import read_timeline
from tailspec.demo.device_share import DeviceShares, share_devices
from tailspec.demo.services import Services, place_workers, resolve_device, trainer_threads
from tailspec.drafter_trainer.rollout_targets import prune_targets
from tailspec.rl import Rollout, grpo_step, policy_drift, recompute_logprobs, save_policy_weights
from tailspec.scheduler.dispatch import warm_ready
from tailspec.tasks.policy import cached_policy, load_policy, resolve_policy
from tailspec.tasks.runsum import grade, sample_problems
from tailspec.tasks.tokenizer import decode_response, encode_prompt

log = logging.getLogger("tailspec.demo")


class Demo:
    """One demo run: services up, the policy and first drafter, the warm-up, `steps` RL steps, export, services
    down. Each RL step is `step`: rollout on the workers while the scheduler lends the tail's GPUs, grade,
    GRPO update, samples to the stream, the next policy version published."""

    def __init__(self, opts: DemoOptions, cfg: TailspecConfig, shares: DeviceShares | None = None):
        """`shares`: the simulated GPUs' CUDA device shares when the caller planned them (a bench running several
        demos on one device shares one plan and one MPS daemon); planned here, and stopped with the services,
        when None on CUDA."""
        self.device = resolve_device(opts.device)
        self.shares, self._own_shares = shares, False
        if self.device == "cuda" and shares is None:
            self.shares, self._own_shares = share_devices(opts.workers, mps=opts.mps), True
        self.placement = place_workers(opts.workers, cfg, self.device, self.shares)
        self.o = replace(opts, workers=self.placement.workers, device=self.device)
        ts = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(opts.run_dir or Path("runs") / ts).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = f"demo-{opts.mode}-{ts}-{os.getpid()}"
        self.base_cfg = cfg
        self.services = Services(self.run_dir, self.placement, opts.redis_url, opts.dashboard,
                                 schedulers=opts.schedulers, redis_aof=opts.redis_aof)
        self.redis_url: str | None = opts.redis_url
        self.r = None  # redis.Redis, once the services are up
        self.client = None  # TailspecClient, once the services are up
        self.cfg: TailspecConfig | None = None  # the run's config (Demo.config), once the services are up
        self.dashboard_url: str | None = None
        # the policy being trained and its published versions
        self.policy_src: Path | None = None
        self.model = self.tokenizer = self.optimizer = None
        self.ref_model = None  # the frozen initial policy of the GRPO KL term (DemoOptions.kl_coef > 0)
        self.cost_tables: dict[str, dict] = {}  # each worker's cost table after the warm-up (run.json's cost_models)
        self.policy_version = 0
        self.policy_path: str | None = None
        self.frozen_path: str | None = None  # the first (bootstrap) drafter; None in nospec
        self.current_drafter_version: int | None = None  # the drafter the last rollout ran
        self.phase_lag_s = 0.0  # the last rollout's last result → its phase change (StepRow.phase_lag_s)
        self.seeded: list[bytes] = []  # stream ids of the bootstrap samples seeded for the first tail
        self.targets_root: str | None = None  # where rollouts ship their training targets (co-trained runs)
        self.exported: dict[str, str] = {}  # what the run produced, from here on
        self.export_errors: dict[str, str] = {}
        self.timeline: list[dict] = []
        self.rows: list[StepRow] = []
        self._drift_prev: list[Rollout] | None = None  # the last step's measured responses (policy_drift's KL)
        self.metrics = None  # metrics.jsonl, open inside `opened`
        self.promotions = 0
        self.worker_restarts = 0
        self.should_stop: Callable[[], bool] | None = None  # checked after each step: end the run early
        self._items: dict[int, bytes] = {}  # each worker's current work item (redone if the worker dies)
        self._costs: dict[str, dict] = {}  # each worker's latest cost table (a replacement starts from it)

    # -- set-up --------------------------------------------------------------------------------------------
    def config(self) -> TailspecConfig:
        c = self.base_cfg.model_copy(deep=True)
        c.cluster.name = self.cluster
        c.cluster.redis_url = self.redis_url
        c.scheduler.telemetry = "simulated"
        c.scheduler.simulated_gpus = self.o.workers
        if self.placement.env is not None:  # sessions run where their simulated GPU's worker runs
            c.scheduler.simulated_gpu_env = dict(enumerate(self.placement.env))
        if self.shares is not None and self.shares.shared:  # every share carries its device's NVML readings
            c.scheduler.simulated_gpu_device = self.shares.devices[0]
            c.scheduler.simulated_gpu_sharing = self.shares.sharing
        c.scheduler.lend = self.o.mode == "cotrained"
        c.scheduler.session_entry = "tailspec.session_entry:ENTRY"
        # A pooled session process still loads the teacher and pulls the lineage head: lend only when the
        # remaining tail is longer than that (the user's value wins); a longer threshold leaves the short tails
        # of a step unlent.
        if "session_startup_s" not in c.scheduler.model_fields_set:
            c.scheduler.session_startup_s = DEMO_SESSION_STARTUP_S
        # Pre-started session processes (torch imported), one per GPU, all started before the first rollout:
        # a lent GPU trains at once instead of importing for seconds, and no process imports during a run.
        c.scheduler.warm_sessions = self.o.workers if self.o.mode == "cotrained" else 0
        # ... and they build the policy's modules while they wait (its versions share one config.json): where the
        # policy is cached already, since the services start before a fresh machine's pre-training
        src = cached_policy(self.o.policy, c.task, cache_dir=c.cache_dir)
        if src is not None and "warm_policy" not in c.scheduler.model_fields_set:
            c.scheduler.warm_policy = str(src.resolve())
        # scheduler.session_nice (default 0) is left to the user's config: at 19 a session takes only the CPU
        # the tail leaves idle, but on 2 cores it is also starved while the RL step runs, and this policy's short
        # tails then often leave it no time to finish a step (`--set scheduler.session_nice=19` to try).
        c.trainer.checkpoint_dir = str(self.run_dir / "drafter")
        apply_demo_trainer(c.trainer, self.o.validation_samples)
        return c

    def start_services(self) -> None:
        self.redis_url = self.services.start_redis()
        self.r = self.services.r
        self.cfg = self.config()
        # the rollout ships each sample's training targets beside it (drafter_trainer/rollout_targets.py)
        if self.o.mode == "cotrained" and self.cfg.trainer.target_source == "rollout":
            self.targets_root = str(self.run_dir / "targets")
        self.services.start(self.cfg, self.o.workers)
        self.client = self.services.client
        self.dashboard_url = self.services.dashboard_url

    def stop_services(self) -> None:
        self.services.stop(self.cluster)
        if self._own_shares:
            self.shares.stop()

    # -- policy and drafters -------------------------------------------------------------------------------
    def load_initial_policy(self) -> None:
        self.policy_src = resolve_policy(self.o.policy, self.cfg.task, cache_dir=Path(self.cfg.cache_dir))
        self.model, self.tokenizer = load_policy(self.policy_src)
        self.model.to(self.device)  # the RL update runs where the rollouts do (fp32 master weights)
        torch.manual_seed(self.o.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.o.lr, betas=(0.9, 0.99), weight_decay=0.0)
        if self.o.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.policy_version = 0
        self.policy_path = self.publish_policy()

    def publish_policy(self) -> str:
        out = save_policy_weights(self.model, self.tokenizer, self.run_dir / "policy" / f"v{self.policy_version}")
        old = self.run_dir / "policy" / f"v{self.policy_version - 2}"
        if old.exists():  # keep two versions: a session may still be reading the previous teacher
            shutil.rmtree(old, ignore_errors=True)
        if self.targets_root is not None:  # targets leave with their samples' versions (keep_policy_versions)
            prune_targets(self.targets_root, self.policy_version - self.cfg.trainer.keep_policy_versions)
        return str(out)

    def bootstrap_drafter(self) -> str:
        """The first drafter: trained offline on the initial policy's own samples (cached per policy).
        The frozen baseline keeps it forever; the co-trained run starts from it."""
        return bootstrap_drafter(self.policy_src, self.cfg, self.o.bootstrap_samples, self.o.bootstrap_seconds,
                                 seed=self.o.seed, steps=self.o.bootstrap_steps, device=self.device)

    def seed_version_store(self) -> None:
        """Version 1 = the bootstrap drafter, promoted; sessions continue from its weights."""
        self.seeded = seed_store(self.frozen_path, self.cfg, self.r)

    def current_drafter(self) -> DrafterVersion | None:
        """The co-trained drafter the workers load at the next phase (None: not co-training, or none promoted)."""
        return current_drafter(self.r, self.cluster) if self.o.mode == "cotrained" else None

    def drafter_for_phase(self) -> tuple[str | None, int | None]:
        if self.o.mode == "nospec":
            return None, None
        cur = self.current_drafter()
        return (self.frozen_path, 0) if cur is None else (cur.path, cur.version)

    # -- one RL step ---------------------------------------------------------------------------------------
    def requests(self, step: int) -> tuple[list, list[WorkRequest]]:
        problems = sample_problems(self.o.prompts_per_step, self.cfg.task, seed=self.o.seed * 100_003 + step)
        reqs = []
        for g, p in enumerate(problems):
            ids = encode_prompt(self.tokenizer, p.prompt)
            for j in range(self.o.group_size):
                rid = g * self.o.group_size + j
                reqs.append(WorkRequest(rid=rid, prompt_ids=ids, seed=self.o.seed * 1_000_003 + step * 10_007 + rid))
        return problems, reqs

    def deal(self, reqs: list[WorkRequest]) -> list[list[WorkRequest]]:
        if self.o.deal == "round_robin":
            return [reqs[w :: self.o.workers] for w in range(self.o.workers)]
        if self.o.deal == "by_length":
            reqs = sorted(reqs, key=lambda q: len(q.prompt_ids))
        n = -(-len(reqs) // self.o.workers)
        return [reqs[w * n : (w + 1) * n] for w in range(self.o.workers)]

    def worker_rollout_config(self):
        """The `rollout` section the workers build their engines from: the user's, with the demo's
        max_seq_len where the user's config does not set one."""
        rc = self.cfg.rollout
        if "max_seq_len" not in rc.model_fields_set:
            rc = rc.model_copy(update={"max_seq_len": self.o.max_seq_len})
        return rc

    def send_work(self, step: int, shares: list[list[WorkRequest]], drafter_path: str | None,
                  drafter_version: int | None, warmup: bool = False) -> None:
        self.r.delete(results_key(self.cluster))  # a round's results start from an empty list
        rc = self.worker_rollout_config()
        tables = (self.o.cost_tables or {}) if warmup else {}
        for w, share in enumerate(shares):
            item = WorkItem(step=step, policy_path=self.policy_path, policy_version=self.policy_version,
                            drafter_path=drafter_path, drafter_version=drafter_version,
                            selector=rc.selector, k=rc.k, rollout=rc.model_dump(mode="json"),
                            temperature=self.o.temperature, states_dir=self.targets_root,
                            max_tokens=self.o.max_tokens, requests=share, warmup=warmup,
                            cost_model=tables.get(f"w{w}"))
            self._items[w] = state.encode(item)
            self.r.rpush(work_key(self.cluster, f"w{w}"), self._items[w])

    def collect(self, step: int, on_progress=None) -> list[WorkResult]:
        key = results_key(self.cluster)
        results: dict[str, WorkResult] = {}  # by worker, in order of arrival
        while len(results) < self.o.workers:
            got = self.r.blpop([key], timeout=1)
            if on_progress is not None:
                on_progress(step, list(results.values()))
            if got is None:
                self.replace_dead_workers(step, results)
                continue
            res = state.decode(WorkResult, got[1], where=key)
            if res.worker in results:  # the second answer to a redone share
                continue
            if res.error:
                raise RuntimeError(f"worker {res.worker} failed at step {step}: {res.error}")
            for v in res.guard:
                if v.get("tripped"):
                    log.warning("step %d, %s: drafter v%s broken after %s (%s): speculation off until another "
                                "version loads", step, res.worker, v.get("version"), v.get("event"), v.get("reason"))
            results[res.worker] = res
            if res.cost_model is not None:
                self._costs[res.worker] = res.cost_model
        return list(results.values())

    def replace_dead_workers(self, step: int | str, results: dict[str, WorkResult]) -> None:
        """Replace every rollout worker whose process died and send its share of the step again (the share it
        was decoding is lost with it); past `max_worker_restarts` in a run, fail the step, naming them."""
        dead = self.services.dead_workers()
        if not dead:
            return
        if self.worker_restarts + len(dead) > self.o.max_worker_restarts:
            raise RuntimeError(f"rollout worker(s) {dead} died at step {step} after {self.worker_restarts} "
                               f"restarts in this run; see {self.run_dir}/worker-*.log")
        for name in dead:
            w = int(name[1:])
            log.warning("step %s: rollout worker %s died; replaced%s", step, name,
                        "" if name in results else ", its share is redone")
            self.services.restart_worker(w, self.cluster, self.cfg.cluster.node)
            self.worker_restarts += 1
            if name not in results and w in self._items:
                item = state.decode(WorkItem, self._items[w], where="redo")
                # the predecessor's cost table: the replacement skips timing its own (seconds of the step); a warm-up
                # redone keeps the table it was given (DemoOptions.cost_tables) where the predecessor reported none
                item = item.model_copy(update={"cost_model": self._costs.get(name) or item.cost_model})
                self.r.rpush(work_key(self.cluster, name), state.encode(item))

    def wait_warm_sessions(self, timeout_s: float = 120.0) -> None:
        """Let the pre-started session processes finish importing before the workers time their cost model:
        imports on the workers' cores would skew the model the adaptive selector picks k from for the whole
        run (co-trained rollouts would run slower than frozen ones with the same drafter)."""
        want, deadline = self.cfg.scheduler.warm_sessions, time.time() + timeout_s
        while warm_ready(self.run_dir / "sessions") < want and time.time() < deadline:
            time.sleep(0.1)

    def warm_up_workers(self, on_progress=None) -> None:
        """Each worker's engine start-up before the first rollout (load the policy and drafter, time the cost model), as
        a real engine's at its start; in step 0 it would hide step 0's tail behind seconds of measuring."""
        drafter_path, drafter_version = self.drafter_for_phase()
        self.send_work(0, self.deal(self.requests(0)[1]), drafter_path, drafter_version, warmup=True)
        results = self.collect(0, None if on_progress is None else lambda _, results: on_progress("warm-up", results))
        self.write_run_record(results)

    def write_run_record(self, warmup: list[WorkResult]) -> None:
        """run.json: the options, the config and each worker's warm-up cost table, which with metrics.jsonl
        is what `tailspec simulate --calibrate RUN_DIR` replays."""
        opts = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.o).items()}
        self.cost_tables = {r.worker: r.cost_model for r in warmup if r.cost_model is not None}
        opts.pop("cost_tables", None)  # written once, below, as what the workers started from
        record = {"options": opts, "config": self.cfg.model_dump(mode="json"), "placement": asdict(self.placement),
                  "cost_models": self.cost_tables, "cost_models_given": self.o.cost_tables is not None}
        (self.run_dir / "run.json").write_text(json.dumps(record, indent=1))

    def rollout(self, step: int, reqs: list[WorkRequest], on_progress=None) -> tuple[list[WorkResult], float]:
        drafter_path, drafter_version = self.drafter_for_phase()
        self.current_drafter_version = drafter_version
        self.client.set_phase("rollout", step, self.policy_version, self.policy_path)
        self.client.flush(2.0)
        t0 = time.time()
        self.send_work(step, self.deal(reqs), drafter_path, drafter_version)
        results = self.collect(step, on_progress)
        t1 = max(r.finished_at for r in results)
        self.phase_lag_s = time.time() - t1  # the last result → the phase change (the scheduler stops counting)
        self.client.set_phase("train", step, self.policy_version, self.policy_path)
        self.client.flush(2.0)
        return results, t1 - t0

    def grade(self, step: int, problems: list, reqs: list[WorkRequest], results: list[WorkResult]
              ) -> tuple[list[Rollout], list[Sample], list[bool], list[str | None]]:
        """The RL framework's part: reward every response, and the samples it submits to tailspec (with each
        response's correctness and scratchpad style, for the step's figures)."""
        by_rid = {o.rid: o for res in results for o in res.outputs}
        req_of = {q.rid: q for q in reqs}
        rollouts: list[Rollout] = []
        samples: list[Sample] = []
        correct: list[bool] = []
        styles: list[str | None] = []
        for rid in sorted(by_rid):
            o, q, group = by_rid[rid], req_of[rid], rid // self.o.group_size
            g = grade(problems[group], decode_response(self.tokenizer, o.token_ids), self.cfg.task)
            correct.append(g.correct)
            styles.append(g.style)
            rollouts.append(Rollout(q.prompt_ids, o.token_ids, o.logprobs, g.reward, group))
            samples.append(Sample(prompt_ids=q.prompt_ids, response_ids=o.token_ids, reward=g.reward,
                                  policy_version=self.policy_version, group_id=f"{step}:{group}",
                                  states_path=o.states_path, states_key=o.states_key))
        return rollouts, samples, correct, styles

    def instrument(self, step: int, rollouts: list[Rollout], samples: list[Sample]) -> Instruments:
        """Not part of an RL step (a user's trainer does neither): the logprob check (one forward of 8
        responses), the policy's entropy and its move since the last step (`policy_drift`: two forwards of
        `measure_samples` responses) and, every `measure_every` steps and at the last, both drafters'
        acceptance. Run after the GPUs are back, so it takes no compute from a session; its time is left out of
        step_time_s."""
        check = rollouts[: min(8, len(rollouts))]
        ref = recompute_logprobs(self.model, check, self.tokenizer.pad_token_id, temperature=self.o.temperature)
        lp_diff = max((abs(a - b) for ro, rf in zip(check, ref) for a, b in zip(ro.logprobs, rf)), default=0.0)
        drift_on = rollouts[: self.o.measure_samples]
        entropy, kl = policy_drift(self.model, drift_on, self._drift_prev, self.tokenizer.pad_token_id,
                                   temperature=self.o.temperature)
        self._drift_prev = drift_on  # sampled by this step's policy, which the update is about to move
        out = Instruments(lp_diff=lp_diff, policy_entropy=entropy, policy_kl=kl)
        if self.o.mode == "nospec" or not (step % self.o.measure_every == 0 or step == self.o.steps - 1):
            return out
        cur = self.current_drafter()
        out.acc_frozen, out.acc_co = measure_acceptance(self.model, self.frozen_path, cur, samples,
                                                        self.o.measure_samples, self.o.k, self.policy_version)
        record_health(self.r, self.cluster, cur, step, self.policy_version, out.acc_frozen, out.acc_co,
                      min(len(samples), self.o.measure_samples))
        return out

    def step(self, step: int, on_progress=None) -> StepRow:
        before = counters(self.r, self.cluster)
        t_start = time.time()
        problems, reqs = self.requests(step)
        results, rollout_s = self.rollout(step, reqs, on_progress)
        t_train = time.time()
        rollouts, samples, correct, styles = self.grade(step, problems, reqs, results)
        # The RL trainer needs every GPU back before its update (the wait a real trainer does for reclaim).
        wait_s = self.wait_sessions_stopped()
        t_measure = time.time()
        inst = self.instrument(step, rollouts, samples)
        measure_s = time.time() - t_measure
        stats = grpo_step(self.model, self.optimizer, rollouts, self.tokenizer.pad_token_id,
                          temperature=self.o.temperature, kl_coef=self.o.kl_coef, ref_model=self.ref_model)
        self.client.submit_samples(samples)
        if self.seeded:  # the first rollout's samples replace the bootstrap's (already learnt; no shipped targets)
            self.r.xdel(state.key(self.cluster, "samples"), *self.seeded)
            self.seeded = []
        self.policy_version += 1
        self.policy_path = self.publish_policy()
        times = StepTimes(start=t_start, train=t_train, end=time.time(), rollout_s=rollout_s, measure_s=measure_s,
                          wait_sessions_s=wait_s, phase_lag_s=self.phase_lag_s)
        row = step_row(step, self.o.mode, times, results, before, counters(self.r, self.cluster),
                       drafter_version=self.current_drafter_version, acc_frozen=inst.acc_frozen,
                       acc_co=inst.acc_co, mean_reward=stats.mean_reward, correct=correct,
                       policy_version=self.policy_version, lp_diff=inst.lp_diff, styles=styles,
                       policy_entropy=inst.policy_entropy, policy_kl=inst.policy_kl)
        publish_rollout_stats(self.r, self.cluster, row)
        return row

    def wait_sessions_stopped(self, timeout_s: float = 15.0) -> float:
        """The trainer owns every GPU now: wait until each is back (TailspecClient.wait_reclaimed). Seconds waited."""
        return self.client.wait_reclaimed(timeout_s).waited_s

    # -- the whole run -------------------------------------------------------------------------------------
    def run(self, on_row=None, on_progress=None) -> list[StepRow]:
        with self.opened(on_progress):
            for step in range(self.o.steps):
                self.record(self.step(step, on_progress), on_row)
                if self.should_stop is not None and self.should_stop():
                    break
        return self.rows

    @contextlib.contextmanager
    def opened(self, on_progress=None):
        """Services up and all before step 0 done; on exit the export, the timeline, services stopped. A bench that
        interleaves demos' steps opens each: between its own steps a demo's phase stays train, so nothing lends."""
        hf_logging.disable_progress_bar()  # a policy saved every step: HF's per-save bar would break the step lines
        threads = torch.get_num_threads()
        torch.set_num_threads(trainer_threads(self.placement))  # the update runs on every simulated GPU's compute
        self.start_services()
        try:
            self.load_initial_policy()
            self.frozen_path = self.bootstrap_drafter() if self.o.mode != "nospec" else None
            if self.o.mode == "cotrained":
                self.seed_version_store()
            self.wait_warm_sessions()
            self.warm_up_workers(on_progress)
            with open(self.run_dir / "metrics.jsonl", "w") as self.metrics:
                yield self
            if self.o.export and self.o.mode != "nospec":
                self.export()
            self.timeline = read_timeline(self.r, self.cluster)
            self.promotions = count_promotions(self.r, self.cluster)
        finally:
            self.stop_services()
            torch.set_num_threads(threads)

    def record(self, row: StepRow, on_row=None) -> None:
        """Keep a finished step's row and append it to metrics.jsonl (inside `opened`)."""
        self.rows.append(row)
        self.metrics.write(json.dumps(asdict(row)) + "\n")
        self.metrics.flush()
        if on_row is not None:
            on_row(row)

    def export(self) -> None:
        self.model.to("cpu")  # the export reads the policy's embedding beside the drafter's host copy
        cur = self.current_drafter()
        path, version = (self.frozen_path, 0) if cur is None else (cur.path, cur.version)
        self.exported, self.export_errors = export_run_drafter(self.model, path, version, self.policy_version,
                                                               self.run_dir)
