"""A demo rollout worker: one process per (simulated) GPU, running the native speculative engine.

It stands where a verl / NeMo-RL rollout worker stands: it takes a batch of prompts, generates with the
current policy and drafter, reports progress to tailspec through the client while it decodes (so the
scheduler sees it drain), and hands tokens + the policy's logprobs back to the RL loop. Work and results
travel as JSON through Redis lists (state keys `demo_work` / `demo_results`), never pickle.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter

import torch

from tailspec import state
from tailspec.state import WorkItem, WorkOutput, WorkResult

log = logging.getLogger("tailspec.demo.worker")


class Worker:
    def __init__(self, name: str, gpu: int, redis_url: str, cluster: str, node: str, max_seq_len: int,
                 k_max: int, progress_period_s: float = 0.1):
        import redis

        from tailspec.scheduler.client import TailspecClient

        self.name, self.gpu, self.cluster = name, gpu, cluster
        self.max_seq_len, self.k_max = max_seq_len, k_max
        self.progress_period_s = progress_period_s
        self.r = redis.Redis.from_url(redis_url)
        self.client = TailspecClient(redis_url, cluster=cluster, node=node)
        self.policy_key: tuple[str | None, int] | None = None
        self.drafter_key: tuple[str | None, int | None] | None = None
        self.model = None
        self.drafter_module = None
        self.cost = None  # measured once per worker on its first speculative phase (same shapes after)
        self.acceptance = None

    def _load_policy(self, item: WorkItem) -> None:
        from tailspec.tasks.policy import load_policy

        key = (item.policy_path, item.policy_version)
        if key != self.policy_key:
            self.model, _ = load_policy(item.policy_path)
            self.policy_key = key
            self.drafter_key = None  # the drafter shares the target's embedding: rebind

    def _load_drafter(self, item: WorkItem) -> None:
        key = (item.drafter_path, item.drafter_version)
        if key == self.drafter_key:
            return
        self.drafter_module = None
        if item.drafter_path:
            from tailspec.drafter_trainer.model import Eagle3Drafter as Eagle3Module

            self.drafter_module = Eagle3Module.load(item.drafter_path,
                                                    target_embedding=self.model.get_input_embeddings())
        self.drafter_key = key

    def _engine(self, item: WorkItem):
        from tailspec.rollout.drafters import Eagle3Drafter
        from tailspec.rollout.engine import Engine

        from tailspec.config import RolloutConfig
        from tailspec.rollout import cost_model
        from tailspec.rollout.acceptance import AcceptanceTracker
        from tailspec.rollout.selector import make_selector

        drafter = Eagle3Drafter(self.drafter_module, target=self.model) if self.drafter_module is not None else None
        k_max = self.k_max if drafter is not None else 0
        eos = self.model.config.eos_token_id
        engine = Engine(self.model, drafter, choose_k=0, max_batch=max(1, len(item.requests)),
                        max_seq_len=self.max_seq_len, k_max=k_max, seed=item.step, eos_token_id=eos)
        if drafter is None:
            return engine
        rc = RolloutConfig(selector=item.selector, k=min(item.k, k_max), k_max=k_max, drafter="eagle3")
        if rc.selector == "adaptive":
            if self.acceptance is None:
                self.acceptance = AcceptanceTracker(k_max=k_max)
            self.acceptance.set_version(item.drafter_version, item.policy_version)
            if self.cost is None:
                prompts = [r.prompt_ids for r in item.requests[:8]]
                buckets = cost_model.default_buckets(len(item.requests))
                self.cost = cost_model.measure(engine, prompts, buckets=buckets, ks=cost_model.default_ks(k_max),
                                               steps=3, on_step=self.acceptance.observe)
                engine.step_log.clear()  # the warm-up is not part of the rollout's strategy mix
        engine.choose_k = make_selector(rc, self.cost, self.acceptance, seed=item.step)
        return engine

    def run_item(self, item: WorkItem) -> WorkResult:
        from tailspec.rollout.sequence import SamplingParams

        started = time.time()
        self._load_policy(item)
        self._load_drafter(item)
        engine = self._engine(item)
        if item.warmup:
            return WorkResult(worker=self.name, step=item.step, outputs=[], started_at=started, finished_at=time.time())
        n = len(item.requests)
        rid_of: dict[int, int] = {}
        for req in item.requests:
            max_tokens = min(item.max_tokens, self.max_seq_len - len(req.prompt_ids))
            sp = SamplingParams(max_tokens=max_tokens, temperature=item.temperature, seed=req.seed)
            rid_of[engine.add_request(req.prompt_ids, sp)] = req.rid
        outputs: list[WorkOutput] = []
        tokens = 0
        last = 0.0
        while engine.has_unfinished():
            for out in engine.step():
                outputs.append(WorkOutput(
                    rid=rid_of[out.request_id], token_ids=out.token_ids, logprobs=out.logprobs,
                    finish_reason=out.finish_reason, target_forwards=out.stats.target_forwards,
                    drafted=out.stats.drafted, accepted=out.stats.accepted))
                tokens += len(out.token_ids)
            now = time.monotonic()
            if now - last >= self.progress_period_s:
                last = now
                self.client.report_progress(self.name, [self.gpu], active=n - len(outputs), finished=len(outputs),
                                            phase="rollout", total=n, step=item.step, tokens_done=tokens)
        # Drained: the scheduler may lend this GPU while the other workers' tail runs.
        self.client.report_progress(self.name, [self.gpu], active=0, finished=n, phase="rollout", total=n,
                                    step=item.step, tokens_done=tokens)
        mix = Counter(str(k) for _, k, _ in engine.step_log)
        return WorkResult(worker=self.name, step=item.step, outputs=outputs, started_at=started,
                          finished_at=time.time(), decode_steps=len(engine.step_log), strategy_mix=dict(mix))

    def serve(self) -> None:
        parent = os.getppid()
        work_key = state.key(self.cluster, "demo_work", worker=self.name)
        results_key = state.key(self.cluster, "demo_results")
        self.client.report_progress(self.name, [self.gpu], active=0, finished=0, phase="idle")
        while os.getppid() == parent:  # the demo died → stop instead of idling forever
            got = self.r.blpop([work_key], timeout=1)
            if got is None:
                continue
            try:
                item = state.decode(WorkItem, got[1], where=work_key)
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
            self.r.rpush(results_key, state.encode(result))
        self.client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tailspec demo rollout worker")
    ap.add_argument("--name", required=True)
    ap.add_argument("--gpu", type=int, required=True)
    ap.add_argument("--redis", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--node", default="node0")
    ap.add_argument("--max-seq-len", type=int, default=640)
    ap.add_argument("--k-max", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one simulated GPU = one core's worth of work; workers share 2 cores
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {args.name}: %(message)s")
    Worker(args.name, args.gpu, args.redis, args.cluster, args.node, args.max_seq_len, args.k_max).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
