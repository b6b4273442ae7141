"""The verify rule's price: acceptance under `residual` and under `coupled`, for chains and trees, with a close
drafter and with a stale one.

Trees multiply the draws a step makes, and a stale drafter sits farther from the policy; the coupled rule's
guarantee per draft is (1 - TV) / (1 + TV) against the residual rule's 1 - TV. This script measures what that
costs in tokens per verify on the task: each (drafter, strategy, rule) decodes the same seeded requests to
completion and reports emitted tokens ÷ target forwards.

Usage (tailspec installed; the policy and drafters are local directories, e.g. a `bench e2e --out DIR` run's last
published policy `DIR/cotrained/policy/vN`, its frozen first drafter and its last promoted version):
    python -P benchmarks/verify_rule_price.py --policy POLICY_DIR --drafter close=DIR --drafter stale=DIR \
        [--strategies chain4,tree2-1-1-1n5,dyn8x4n32] [--requests 32] [--batch 16] [--temperature 1]
Prints one JSON object: {drafter: {strategy: {rule: tokens per verify}}} and the coupled ÷ residual ratios.
"""

from __future__ import annotations

import argparse
import json

import torch
from tailspec.core.config import TailspecConfig
from tailspec.drafter_trainer.model import Eagle3Module
from tailspec.rollout.drafters import Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams
from tailspec.rollout.strategy import Strategy

from tailspec.tasks.policy import load_policy
from tailspec.tasks.runsum import sample_problems
from tailspec.tasks.tokenizer import encode_prompt


def tokens_per_verify(target, head, strategy: Strategy, rule: str, prompts, params, batch: int) -> float:
    eng = Engine(target, Eagle3Proposer(head, target), selector=lambda n, last: strategy, max_batch=batch,
                 max_seq_len=1024, k_max=max(8, strategy.depth), verify_rule=rule)
    outs = eng.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / sum(o.stats.target_forwards for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", required=True)
    p.add_argument("--drafter", action="append", required=True, help="NAME=DIR of an EAGLE-3 drafter (repeatable)")
    p.add_argument("--strategies", default="chain4,tree2-1-1-1n5,dyn8x4n32")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = TailspecConfig()
    target, tok = load_policy(a.policy)
    prompts = [encode_prompt(tok, q.prompt) for q in sample_problems(a.requests, cfg.task, seed=4242)]
    params = [SamplingParams(max_tokens=min(a.max_tokens, 1024 - len(q)), temperature=a.temperature, seed=i)
              for i, q in enumerate(prompts)]
    out: dict = {"policy": a.policy, "temperature": a.temperature, "requests": a.requests, "batch": a.batch}
    for spec in a.drafter:
        name, path = spec.split("=", 1)
        head = Eagle3Module.load(path, target.get_input_embeddings())
        rows = out.setdefault(name, {})
        for label in a.strategies.split(","):
            s = Strategy.parse(label)
            r = {rule: round(tokens_per_verify(target, head, s, rule, prompts, params, a.batch), 3)
                 for rule in ("residual", "coupled")}
            r["coupled_over_residual"] = round(r["coupled"] / r["residual"], 3)
            rows[s.label] = r
            print(name, s.label, r, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
