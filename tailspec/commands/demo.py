"""`tailspec demo`: the main job on the built-in default.

Today it builds (or loads from the cache) the tiny policy, evaluates it on the synthetic task and prints
the long-tail picture that tailspec exists for: most responses finish early, a few run long, and every
GPU that finished waits for them.
"""

from __future__ import annotations

import argparse

import numpy as np


def register(sub: argparse._SubParsersAction) -> None:
    from tailspec.cli import add_config_args

    p = sub.add_parser("demo", help="run the main job on the built-in task and tiny policy")
    p.add_argument("--policy", default="tiny", metavar="DIR|PRESET", help="policy directory or preset (default tiny)")
    p.add_argument("-n", type=int, default=256, help="problems to evaluate (default 256)")
    p.add_argument("--workers", type=int, default=4, help="rollout workers (GPUs) to split the batch over")
    p.add_argument("--seed", type=int, default=10_000)
    add_config_args(p)
    p.set_defaults(func=_demo)


def idle_share(lengths: list[int], workers: int, seed: int = 0) -> tuple[float, list[int]]:
    """Share of worker-time left idle when `lengths` (decode steps per response) are dealt round-robin to
    `workers` workers that each decode their share as one batch: a worker is busy for as many steps as its
    longest response, and the rollout lasts as long as the slowest worker."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    busy = [max((lengths[i] for i in order[w::workers]), default=0) for w in range(workers)]
    total = max(busy) * workers
    return (1.0 - sum(busy) / total) if total else 0.0, busy


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tailspec.cli import config_from_args
    from tailspec.commands.task import eval_policy, print_eval, resolve_policy

    console = Console()
    cfg = config_from_args(args)
    console.rule("[bold]tailspec demo")
    console.print("1. policy: the built-in tiny Llama, pre-trained on the running-sum task (cached after the first run)")
    policy = resolve_policy(args.policy, cfg)
    console.print(f"2. rollout: {args.n} problems sampled at temperature 1.0")
    r = eval_policy(policy, cfg, args.n, 1.0, args.seed)
    print_eval(r)
    share, busy = idle_share(r["lengths"], args.workers)
    console.print(f"\n3. the long tail: {args.workers} workers, each decoding its share of the batch")
    for w, b in enumerate(busy):
        bar = "█" * int(40 * b / max(busy))
        console.print(f"   worker {w}: busy {b:>4} steps {bar}")
    console.print(f"   → {share:.0%} of worker-time is idle, waiting for the longest responses. "
                  "tailspec lends that time to drafter training.")
    return 0
