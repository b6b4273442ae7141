"""Task benchmark: pre-train a policy preset from scratch, then accuracy and response-length tail at T=1.

The preset defaults to the main job's (`tailspec demo`'s DemoOptions.policy), so the figures are those of the
policy the demo runs; `--preset` picks another."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tailspec.benchmarks.machine import machine

from tailspec.commands.args import config_from_args
from tailspec.demo.options import DemoOptions


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=DemoOptions.policy, choices=["micro", "micro4", "tiny", "deep", "small", "gpu"],
                   help=f"policy preset (default {DemoOptions.policy}: the one `tailspec demo` runs)")
    p.add_argument("-n", type=int, default=512, help="evaluation problems (default 512)")
    p.add_argument("--cached", action="store_true",
                   help="reuse the cached policy instead of training a fresh one (train_seconds then comes "
                        "from the cache's record)")
    p.add_argument("--device", default=None, help="training device (default cpu)")


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.commands.task import eval_policy, print_eval
    from tailspec.tasks.policy import get_policy, policy_meta

    cfg = config_from_args(args)
    with tempfile.TemporaryDirectory(prefix="tailspec-bench-task-") as tmp:
        cache = Path(cfg.cache_dir) if args.cached else Path(tmp)
        t0 = time.perf_counter()
        path = get_policy(args.preset, cfg.task, cache_dir=cache, device=args.device, eval_n=64)
        build_s = time.perf_counter() - t0
        meta = policy_meta(path)
        r = eval_policy(str(path), cfg, n=args.n, temperature=1.0, seed=10_000)
    print_eval(r, out=sys.stderr if args.json else sys.stdout)
    print(f"pre-training: {meta['train_seconds']:.1f}s for {meta['train_steps']} steps "
          f"(build incl. eval {build_s:.1f}s) on {machine()}", file=sys.stderr if args.json else sys.stdout)
    return {
        "preset": args.preset, "device": machine(), "params": meta["params"],
        "train_seconds": round(meta["train_seconds"], 2), "accuracy": r["accuracy"],
        "well_formed": r["well_formed"], "len_p50": r["len_p50"], "len_p90": r["len_p90"],
        "len_p99": r["len_p99"], "tail_ratio": round(r["tail_ratio"], 3),
        "gold_len_p50": r["gold_len_p50"], "gold_len_p99": r["gold_len_p99"], "n": r["n"],
    }
