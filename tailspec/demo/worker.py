"""A demo rollout worker: one process per (simulated) GPU, running the native speculative engine.

It stands where a verl / NeMo-RL rollout worker stands: it takes a batch of prompts, generates with the
current policy and drafter, reports progress to tailspec through the client while it decodes (so the
scheduler sees it drain), and hands tokens + the logprobs of the distribution it sampled from back to the RL
loop. Work and results travel as JSON through Redis lists (tailspec.demo.protocol), never
pickle. Each work item carries the run's `rollout` config section, and the worker builds its engine from it:
selector, k, k_max, epsilon, max_batch, max_seq_len, dtype, drafter kind, and a CUDA graph pool for the verify
forward when `rollout.cuda_graphs` is on and CUDA is present (CUDA device `gpu` when there is one). An item that
names a `states_dir` (a co-trained run) has the engine record each request's training targets, which the worker
writes there after its drain report, each output naming its entry (drafter_trainer/rollout_targets.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

from tailspec.core import state
from tailspec.core.config import RolloutConfig
from tailspec.core.redis_conn import connect
from tailspec.core.state import DrafterVersion, Event
from tailspec.demo.protocol import WorkItem, WorkOutput, WorkResult, results_key, work_key
from tailspec.drafter_load import load_drafter
from tailspec.drafter_trainer.rollout_targets import write_targets
from tailspec.rollout import cost_model
from tailspec.rollout.acceptance import AcceptanceTracker
from tailspec.rollout.cost_model import CostModel
from tailspec.rollout.drafters import Eagle3Proposer, NgramProposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.graph_pool import build_pool
from tailspec.rollout.health_guard import GuardPolicy, HealthGuard, guarded, record_verdict, validated_alpha
from tailspec.rollout.selector import make_selector
from tailspec.rollout.sequence import SamplingParams
from tailspec.scheduler import cpu_quota
from tailspec.scheduler.client import TailspecClient
from tailspec.scheduler.placement import parse_cpus, pin

log = logging.getLogger("tailspec.demo.worker")


def rollout_config(item: WorkItem):
    """The run's `rollout` config section as the RL loop sent it with the work (selector, k, k_max, epsilon,
    max_batch, max_seq_len, cuda_graphs, graph_memory_budget_mb, dtype, drafter). An item without one gets
    the section's defaults with the item's selector and k."""
    if item.rollout is not None:
        return RolloutConfig.model_validate(item.rollout)
    return RolloutConfig(selector=item.selector, k=item.k)


def work_output(rid: int, out) -> WorkOutput:
    """A finished request for the RL loop. Its logprobs are those of the distribution each token was sampled
    from (the policy at the rollout's temperature: `sampling_logprobs`), the old logprobs of GRPO's ratio; the
    raw T = 1 logprobs would make the ratio compare two distributions whenever T != 1."""
    return WorkOutput(rid=rid, token_ids=out.token_ids, logprobs=out.sampling_logprobs,
                      finish_reason=out.finish_reason, target_forwards=out.stats.target_forwards,
                      drafted=out.stats.drafted, accepted=out.stats.accepted)


def strategy_key(s) -> str:
    """How a strategy is named in a step's figures (strategy mix, accepted by strategy): a chain by its k, as
    always ("0" plain decoding), a tree by its label."""
    return s.label if s.is_tree else str(s.depth)


def plan_ks(rc) -> list[int] | None:
    """The draft lengths the configured selector can pick (what a graph pool should capture); None = the
    adaptive selector's candidates from the cost model (beg may pick any k up to k_max: the same)."""
    k = min(rc.k, rc.k_max)
    if rc.drafter == "none":
        return [0]
    if rc.selector == "fixed":
        return [k]
    if rc.selector == "threshold":
        return sorted({0, k})
    return None


def attach_graph_pool(engine, rc, cost, emulate: bool = False):
    """`rollout.cuda_graphs` on and the engine on CUDA: capture the verify forward's CUDA graphs (plan from the
    cost model, within `rollout.graph_memory_budget_mb`) and attach them to the engine; None otherwise.
    `emulate` runs the same plan's padded static-buffer path on CPU (tests)."""
    if not rc.cuda_graphs or cost is None or (engine.device.type != "cuda" and not emulate):
        return None
    ks = plan_ks(rc)
    if ks is not None:
        ks = [k for k in ks if k in cost.ks] or None
    return build_pool(engine, cost, rc.graph_memory_budget_mb << 20, ks=ks, emulate=emulate)


def validated_version(drafter_path: str | None) -> DrafterVersion | None:
    """A version's record as the version store writes it beside its weights (version.json: its validated
    acceptance, the draft length or strategy mix it was scored under, its rank table); None when there is none
    or it does not parse."""
    f = Path(drafter_path) / "version.json" if drafter_path else None
    if f is None or not f.is_file():
        return None
    try:
        return DrafterVersion.model_validate_json(f.read_text())
    except (OSError, ValueError) as e:
        log.warning("drafter guard: %s unreadable (%s); judging by the floor only", f, e)
        return None



def worker_device(gpu: int, device: str = "auto") -> torch.device:
    """The worker's accelerator: on `cuda` (or `auto` where CUDA is present) CUDA device `gpu` modulo the devices
    it sees (the demo starts it seeing its own device only: tailspec/demo/device_share.py), else the CPU."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", gpu % torch.cuda.device_count())
    return torch.device("cpu")


class Worker:
    def __init__(self, name: str, gpu: int, redis_url: str, cluster: str, node: str,
                 progress_period_s: float = 0.1, device: str = "auto"):
        self.name, self.gpu, self.cluster = name, gpu, cluster
        self.device = worker_device(gpu, device)
        self.progress_period_s = progress_period_s
        self.r = connect(redis_url)  # rides out a Redis restart (fault drills: tailspec bench faults)
        self.client = TailspecClient(redis_url, cluster=cluster, node=node)
        self.policy_key: tuple | None = None
        self.policy_config: tuple | None = None  # (config.json, dtype, device) of the loaded policy module
        self.drafter_key: tuple | None = None
        self.model = None
        self.drafter_module = None
        # measured once per worker on its first phase that needs one (same shapes after), per engine shape
        self.cost = None
        self.cost_key: tuple | None = None
        self.cost_graphed = False  # the table was timed through a graph pool's replays
        self.acceptance = None
        self.pool = None  # the last engine's graph pool (None: eager)
        self.guard = None  # the drafter health guard (rollout.health_guard), one per worker across its engines
        self.verdicts: list[dict] = []  # verdicts reached during the current item

    def _load_policy(self, item: WorkItem, rc) -> None:
        # deferred: transformers (tasks.policy imports it) starts a thread when it loads: after main() pinned
        # this process to its GPU's cores, so that thread runs on them too
        from tailspec.tasks.policy import load_policy
        from tailspec.tasks.policy_sync import load_weights_in_place

        key = (item.policy_path, item.policy_version, rc.dtype, str(self.device))
        if key == self.policy_key:
            return
        # A new policy version of the same architecture is synced into the loaded module, as an RL framework
        # syncs its rollout engine's weights each step: building the modules anew (from_pretrained) would cost a
        # rollout on a simulated GPU's share of a core far more than a GPU cluster's weight sync costs its own.
        config = (Path(item.policy_path) / "config.json").read_text()
        same = self.model is not None and self.policy_config == (config, rc.dtype, str(self.device))
        if not (same and load_weights_in_place(self.model, item.policy_path)):
            self.model, _ = load_policy(item.policy_path, dtype=getattr(torch, rc.dtype))
            self.model.to(self.device)
        self.policy_key, self.policy_config = key, (config, rc.dtype, str(self.device))
        self.drafter_key = None  # the drafter shares the target's embedding: rebind

    def _load_drafter(self, item: WorkItem, rc) -> None:
        """The drafter the phase decodes with: none without a drafter path (plain decoding: the nospec
        baseline) or with `rollout.drafter: none`; else the `rollout.drafter` kind (eagle3: the item's
        checkpoint; ngram: prompt lookup)."""
        key = (item.drafter_path, item.drafter_version, rc.drafter)
        if key == self.drafter_key:
            return
        self.drafter_module = None
        if item.drafter_path and rc.drafter == "eagle3":
            self.drafter_module = load_drafter(item.drafter_path, self.model, dtype=getattr(torch, rc.dtype))
        self.drafter_key = key

    def _drafter(self, item: WorkItem, rc):
        if not item.drafter_path or rc.drafter == "none":
            return None
        if rc.drafter == "ngram":
            return NgramProposer()
        if rc.drafter == "draft_model":
            raise ValueError("rollout.drafter=draft_model: the demo has no draft model; use eagle3 (co-trained), "
                             "ngram or none")
        return Eagle3Proposer(self.drafter_module, target=self.model)

    def _measure_cost(self, engine, item: WorkItem, rc, on_step=None, force: bool = False) -> None:
        """The cost model t(b, k) of this engine's shape, timed on the first phase that needs one (the
        adaptive selector, or a graph pool's plan) and reused while the shape stays (same drafter kind, k_max,
        dtype, device, graphs on or off; batch within the measured buckets). `force`: time it again (through a
        graph pool just attached)."""
        key = (engine.k_max, type(engine.drafter).__name__, rc.dtype, str(self.device), rc.cuda_graphs)
        if not force and self.cost is not None and self.cost_key == key and engine.max_batch <= max(self.cost.buckets):
            return
        self.cost_graphed = False
        given = None
        if not force and self.cost is None and item.cost_model is not None:
            given = cost_model.CostModel.from_dict(item.cost_model)
            if engine.max_batch > max(given.buckets) or set(given.ks) != set(self._strategies(engine, rc)):
                given = None
        if given is not None and not item.warmup:  # a replacement: its predecessor's table, no timing
            self.cost, self.cost_key = given, key
            return
        prompts = [r.prompt_ids for r in item.requests[:8]]
        timed = cost_model.measure(engine, prompts, buckets=cost_model.default_buckets(engine.max_batch),
                                   ks=self._strategies(engine, rc), steps=3,
                                   temperature=item.temperature, on_step=on_step)
        # A warm-up given a table still runs its steps (the acceptance tracker starts from their drafts, and the
        # start-up takes the same time) and then keeps the table it was given in place of its own timings.
        self.cost, self.cost_key = (given if given is not None else timed), key

    @staticmethod
    def _strategies(engine, rc) -> list:
        """The strategy space of this engine: the default chains up to k_max and, with `rollout.trees` and a drafter
        that drafts trees, the default trees."""
        return cost_model.default_strategies(engine.k_max, trees=rc.trees and engine.max_tree_nodes > 0,
                                             max_nodes=engine.max_tree_nodes)

    def _engine(self, item: WorkItem, rc):
        drafter = self._drafter(item, rc)
        k_max = rc.k_max if drafter is not None else 0
        eos = self.model.config.eos_token_id
        engine = Engine(self.model, drafter, selector=0, max_batch=max(1, min(rc.max_batch, len(item.requests))),
                        max_seq_len=rc.max_seq_len, k_max=k_max, seed=item.step, eos_token_id=eos,
                        verify_rule=rc.verify_rule,
                        record_states=bool(item.states_dir) and drafter is not None and drafter.needs_aux)
        self.pool = None
        adaptive = drafter is not None and rc.selector == "adaptive"
        wants_pool = rc.cuda_graphs and engine.device.type == "cuda"
        if adaptive:
            if self.acceptance is None or self.acceptance.k_max != k_max:
                self.acceptance = AcceptanceTracker(k_max=k_max)
            # a promoted version starts from what it was validated at (as LiveVllm's tracker does), not blind
            info = validated_version(item.drafter_path)
            prior = None if info is None or info.acceptance_length is None else validated_alpha(
                info.acceptance_length, info.validation_k or 4, info.rank_rates)
            self.acceptance.set_version(item.drafter_version, item.policy_version, prior=prior, carry=rc.drafter_carry)
        on_step = self.acceptance.observe if adaptive else None
        if adaptive or wants_pool:
            self._measure_cost(engine, item, rc, on_step=on_step)
        if wants_pool:
            self._attach_pool(engine, item, rc, on_step)
        if drafter is not None:
            selector = make_selector(rc.model_copy(update={"k": min(rc.k, k_max)}), self.cost,
                                     self.acceptance if adaptive else None, seed=item.step,
                                     planned=self.pool is not None)
            if self.guard is not None and self.drafter_module is not None:
                selector = guarded(selector, self.guard, on_verdict=self._on_verdict)
            engine.configure(selector=selector)
        return engine

    def _attach_pool(self, engine, item: WorkItem, rc, on_step=None, emulate: bool = False) -> None:
        """Capture the verify graphs (planned from the cost table) and, the first time for this shape, time the
        table again through the replays: the selector must weigh the forward that runs, and on a GPU a replayed
        verify step costs a fraction of the eager one the first table timed. `emulate`: CPU tests."""
        t0 = time.perf_counter()
        self.pool = attach_graph_pool(engine, rc, self.cost, emulate=emulate)
        if self.pool is None:
            return
        log.info("CUDA graph pool: %d graphs (%d shapes left eager), %.0f MiB, captured in %.2f s",
                 len(self.pool.graphs), len(self.pool.plan.skipped), self.pool.pool_bytes_measured / 2**20,
                 time.perf_counter() - t0)
        if not self.cost_graphed:
            self._measure_cost(engine, item, rc, on_step=on_step, force=True)
            self.cost_graphed = True

    def run_item(self, item: WorkItem) -> WorkResult:
        started = time.time()
        rc = rollout_config(item)
        before = (self.policy_key, self.drafter_key)
        self._load_policy(item, rc)
        self._load_drafter(item, rc)
        self.verdicts = []
        self._arm_guard(item, rc, *before)
        engine = self._engine(item, rc)
        if item.warmup:
            return WorkResult(worker=self.name, step=item.step, outputs=[], started_at=started, finished_at=time.time(),
                              cost_model=self.cost.to_dict() if self.cost is not None else None)
        setup_s = time.time() - started
        n = len(item.requests)
        rid_of: dict[int, int] = {}
        for req in item.requests:
            max_tokens = min(item.max_tokens, rc.max_seq_len - len(req.prompt_ids))
            sp = SamplingParams(max_tokens=max_tokens, temperature=item.temperature, seed=req.seed)
            rid_of[engine.add_request(req.prompt_ids, sp)] = req.rid
        outputs, records, states = self._decode(engine, item, rid_of)
        # Drained: the engine (the target's KV cache, the drafter's, a graph pool) is dropped before the report,
        # so mem_released=True is true, and the scheduler may lend this GPU at once while the tail runs. The
        # next item builds its engine anew (it does at every item: the shape follows the item).
        engine = self.pool = None  # noqa: F841 - the last references to the engine and its caches
        drained_at = time.time()
        self.client.report_progress(self.name, [self.gpu], active=0, finished=n, phase="rollout", total=n,
                                    step=item.step, tokens_done=sum(len(o.token_ids) for o in outputs),
                                    mem_released=True)
        self._ship_targets(item, outputs, states)
        mix = Counter(strategy_key(r.strategy) for r in records)
        by_k: dict[str, list[int]] = {}
        for r in records:
            cell = by_k.setdefault(strategy_key(r.strategy), [0, 0])
            cell[0] += r.rows
            cell[1] += r.accepted
        return WorkResult(worker=self.name, step=item.step, outputs=outputs, started_at=started,
                          finished_at=time.time(), decode_steps=len(records), strategy_mix=dict(mix),
                          setup_s=setup_s, decode_s=sum(r.seconds for r in records), drained_at=drained_at,
                          accepted_by_k=by_k,
                          cost_model=self.effective_cost(), guard=self.verdicts)

    def _arm_guard(self, item: WorkItem, rc, policy_before: tuple | None, drafter_before: tuple | None) -> None:
        """Arm the health guard when a trained drafter was loaded (a new version: load / reload) or the policy
        weights under the same version changed (policy_sync). The version's validated acceptance (and, scored
        under the rollouts' strategy mix, its rank table, which the guard then judges every strategy by) comes
        from its version.json, when the version store wrote one."""
        if not rc.guard or self.drafter_module is None:
            return
        policy = GuardPolicy(rc.guard_window_steps, rc.guard_floor, rc.guard_min_gain_share)
        if self.guard is None or self.guard.policy != policy:
            self.guard = HealthGuard(policy)
        version_before = drafter_before[1] if drafter_before is not None else None
        if drafter_before is not None and version_before == item.drafter_version and policy_before == self.policy_key:
            return  # nothing changed under the drafter
        if version_before != item.drafter_version or drafter_before is None:
            event = "load" if drafter_before is None and self.guard.version is None else "reload"
        else:
            event = "policy_sync"
        info = validated_version(item.drafter_path)
        if info is None:
            self.guard.arm(item.drafter_version, None, event)
        else:
            self.guard.arm(item.drafter_version, info.acceptance_length, event, validated_k=info.validation_k or 4,
                           rank_rates=info.rank_rates)

    def _on_verdict(self, v) -> None:
        d = asdict(v)
        self.verdicts.append(d)
        if v.tripped:
            log.warning("%s: %s", self.name, v.message())
        try:  # best effort: the dashboards' event log; the verdict also travels with the work result
            state.append(self.r, state.key(self.cluster, "events"),
                         Event(kind="drafter_guard", detail={"worker": self.name, **d}))
            record_verdict(self.r, self.cluster, self.name, v)
        except Exception as e:  # noqa: BLE001 - a lost event must not fail the rollout
            log.warning("drafter_guard event not recorded: %s", e)

    def _ship_targets(self, item: WorkItem, outputs: list[WorkOutput], states: dict[int, tuple]) -> None:
        """Write the rollout's training targets (after the drain report: host memory and disk, not the GPU's) and
        point each output at its entry. A failed write costs the sessions a teacher forward, not the rollout."""
        if not states:
            return
        try:
            d = write_targets(item.states_dir, item.policy_version, self.name, {str(r): st for r, st in states.items()},
                              self.drafter_module.config.aux_layer_ids)
        except (OSError, ValueError) as e:
            log.warning("rollout targets not written (%s); sessions run the teacher's forward", e)
            return
        for o in outputs:
            if o.rid in states:
                o.states_path, o.states_key = str(d), str(o.rid)

    def _decode(self, engine, item: WorkItem, rid_of: dict[int, int]) -> tuple[list[WorkOutput], list, dict]:
        """Run the queued requests to completion, reporting progress; returns the outputs, the engine's record
        of every decode step of the rollout (the warm-up's are not among them) and the recorded targets by rid."""
        n = len(rid_of)
        outputs: list[WorkOutput] = []
        states: dict[int, tuple] = {}
        records = []
        tokens = 0
        last = 0.0
        while engine.has_unfinished():
            for out in engine.step():
                outputs.append(work_output(rid_of[out.request_id], out))
                tokens += len(out.token_ids)
                if out.states is not None:
                    states[rid_of[out.request_id]] = out.states
            records.append(engine.last)
            now = time.monotonic()
            if now - last >= self.progress_period_s:
                last = now
                self.client.report_progress(self.name, [self.gpu], active=n - len(outputs), finished=len(outputs),
                                            phase="rollout", total=n, step=item.step, tokens_done=tokens)
        return outputs, records, states

    def effective_cost(self) -> dict | None:
        """t(b, k) as the engine's cost model predicts it now (the warm-up table times what the rollout's own
        steps taught it), for the run record."""
        if self.cost is None:
            return None
        c = self.cost
        return CostModel(list(c.buckets), list(c.ks), {(b, k): c.t(b, k) for b in c.buckets for k in c.ks}).to_dict()

    def serve(self) -> None:
        parent = os.getppid()
        wkey, rkey = work_key(self.cluster, self.name), results_key(self.cluster)
        self.client.report_progress(self.name, [self.gpu], active=0, finished=0, phase="idle")
        while os.getppid() == parent:  # the demo died → stop instead of idling forever
            got = self.r.blpop([wkey], timeout=1)
            if got is None:
                continue
            try:
                item = state.decode(WorkItem, got[1], where=wkey)
            except state.StateError as e:
                log.error("dropping malformed work item: %s", e)
                continue
            if item.stop:
                break
            try:
                result = self.run_item(item)
            except Exception as e:  # one bad batch must not kill the worker; the RL loop sees the error
                log.exception("rollout failed")
                result = WorkResult(worker=self.name, step=item.step, outputs=[], started_at=time.time(),
                                    finished_at=time.time(), error=f"{type(e).__name__}: {e}")
            self.r.rpush(rkey, state.encode(result))
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tailspec demo rollout worker")
    ap.add_argument("--name", required=True)
    ap.add_argument("--gpu", type=int, required=True)
    ap.add_argument("--redis", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--node", default="node0")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="cuda: CUDA device --gpu modulo the devices this process sees; auto: CUDA where present")
    ap.add_argument("--cpus", help="the simulated GPU's own cores, e.g. '0' or '2,3': pin to them (default: share all)")
    ap.add_argument("--cgroup", help="the simulated GPU's CPU quota (a cgroup directory) to join")
    args = ap.parse_args(argv)
    if args.cgroup:
        cpu_quota.join(args.cgroup)  # the GPU's share of its core, with any session lent on this GPU
    if args.cpus:
        pin(parse_cpus(args.cpus))  # the GPU's cores, shared only with a session lent on this GPU
    else:
        torch.set_num_threads(1)  # one simulated GPU = one core's worth of work, sharing the host's cores
    # deferred: transformers starts a thread when it loads; after pin() it runs on the GPU's own cores
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {args.name}: %(message)s")
    Worker(args.name, args.gpu, args.redis, args.cluster, args.node, device=args.device).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
