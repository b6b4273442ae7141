"""End-to-end benchmark: the demo's RL loop run three ways with the same seeds (no SD; SD with a frozen drafter; SD with co-training)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=4, help="RL steps per run (default 4)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--policy", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-first", type=int, default=1,
                   help="steps left out of the step-time mean (default 1: the first runs on cold caches; the engines' "
                        "warm-up runs before step 0 and is in no step)")
    p.add_argument("--out", metavar="DIR", help="keep the three run directories here (default: a temp dir)")


def run(args: argparse.Namespace) -> dict:
    from tailspec.cli import config_from_args
    from tailspec.commands.bench import machine
    from tailspec.demo.run import Demo, DemoOptions

    cfg = config_from_args(args)
    out = print_to = sys.stderr if args.json else sys.stdout
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="tailspec-bench-e2e-")
    root = Path(args.out or tmp.name)
    runs = {}
    for mode in ("nospec", "frozen", "cotrained"):
        opts = DemoOptions(steps=args.steps, workers=args.workers, mode=mode, seed=args.seed, policy=args.policy,
                           prompts_per_step=args.prompts, group_size=args.group, run_dir=root / mode,
                           dashboard=False, export=False)
        print(f"== {mode}: {args.steps} steps, {args.workers} workers", file=out)
        rows = Demo(opts, cfg).run(on_row=lambda r: print(
            f"  step {r.step}: {r.step_time_s:.1f}s (rollout {r.rollout_time_s:.1f}s) acc.len {r.acceptance_length:.2f}"
            f" idle {r.idle_gpu_seconds:.1f} lent {r.lent_gpu_seconds:.1f} reward {r.mean_reward:.2f}", file=print_to))
        runs[mode] = rows

    def mean_of(rows, attr):
        # The mean, not the median: the three runs share seeds, so step i does the same work in every mode
        # and the means compare the same total work; steps differ a lot in length (the long tail), and a
        # median picks a different step in each mode.
        xs = [getattr(r, attr) for r in rows[args.skip_first:]] or [getattr(r, attr) for r in rows]
        return statistics.fmean(xs)

    step = {m: mean_of(rows, "step_time_s") for m, rows in runs.items()}
    rollout = {m: mean_of(rows, "rollout_time_s") for m, rows in runs.items()}
    co = runs["cotrained"]
    idle = sum(r.idle_gpu_seconds for r in co)
    lent = sum(r.lent_gpu_seconds for r in co)
    result = {
        "device": machine(),
        "steps": args.steps,
        "workers": args.workers,
        "step_time_s": {m: round(v, 3) for m, v in step.items()},  # mean over steps skip_first+
        "step_times_s": {m: [round(r.step_time_s, 3) for r in rows] for m, rows in runs.items()},
        "rollout_time_s": {m: round(v, 3) for m, v in rollout.items()},
        "speedup_vs_nospec": {m: round(step["nospec"] / step[m], 3) for m in ("frozen", "cotrained")},
        "rollout_speedup_vs_nospec": {m: round(rollout["nospec"] / rollout[m], 3) for m in ("frozen", "cotrained")},
        "acceptance_first_last": {
            "frozen": [runs["frozen"][0].acceptance_frozen, runs["frozen"][-1].acceptance_frozen],
            "cotrained": [co[0].acceptance_cotrained, co[-1].acceptance_cotrained],
        },
        "frozen_on_cotrained_samples_first_last": [co[0].acceptance_frozen, co[-1].acceptance_frozen],
        "reclaimed_share": round(lent / idle, 3) if idle else 0.0,
        "idle_gpu_seconds": round(idle, 2),
        "lent_gpu_seconds": round(lent, 2),
        "reward_final": {m: rows[-1].mean_reward for m, rows in runs.items()},
        "reward_curves": {m: [r.mean_reward for r in rows] for m, rows in runs.items()},
        "logprob_max_abs_diff": max(r.logprob_max_abs_diff for rows in runs.values() for r in rows),
    }
    print(f"step time (mean, steps {args.skip_first}+): " +
          ", ".join(f"{m} {v:.1f}s" for m, v in step.items()) +
          f"; co-trained speedup {result['speedup_vs_nospec']['cotrained']:.2f}x, frozen "
          f"{result['speedup_vs_nospec']['frozen']:.2f}x; reclaimed share {result['reclaimed_share']:.2f}", file=out)
    if tmp is not None:
        tmp.cleanup()
    return result
