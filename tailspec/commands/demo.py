"""`tailspec demo`: the main job on the built-in default.

A real GRPO loop on the tiny policy, rollouts on N simulated GPUs (worker processes running the adaptive
speculative engine), the scheduler lending the GPUs the long tail idles to drafter training, candidates
validated and promoted, workers loading the promoted drafter at the next phase, and at the end a run
directory with report.md, metrics.jsonl, plots and the exported drafter.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from tailspec.cli import add_config_args

    p = sub.add_parser("demo", help="RL with long-tail rollouts, idle-GPU drafter co-training, export (the main job)")
    p.add_argument("--steps", type=int, default=6, help="RL steps (default 6)")
    p.add_argument("--workers", type=int, default=4, help="simulated GPUs / rollout workers (default 4)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-spec", action="store_true", help="baseline: plain decoding, no co-training")
    mode.add_argument("--frozen-drafter", action="store_true",
                      help="baseline: speculative decoding with the first drafter, never retrained")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="tiny", help="policy preset (micro|tiny|small) or directory (default tiny)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per RL step (default 16)")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group, default 4)")
    p.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a private redis-server")
    p.add_argument("--run-dir", metavar="DIR", help="default runs/<timestamp>")
    p.add_argument("--no-dashboard", action="store_true", help="do not serve the live web dashboard")
    p.add_argument("--bootstrap-seconds", type=float, default=60.0,
                   help="training budget of the first (offline) drafter, cached per policy (default 60)")
    add_config_args(p)
    p.set_defaults(func=_demo)


def options_from_args(args: argparse.Namespace):
    from tailspec.demo.run import DemoOptions

    mode = "nospec" if args.no_spec else "frozen" if args.frozen_drafter else "cotrained"
    return DemoOptions(steps=args.steps, workers=args.workers, mode=mode, seed=args.seed, policy=args.policy,
                       prompts_per_step=args.prompts, group_size=args.group, redis_url=args.redis,
                       run_dir=Path(args.run_dir) if args.run_dir else None, dashboard=not args.no_dashboard,
                       bootstrap_seconds=args.bootstrap_seconds)


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from tailspec.cli import config_from_args
    from tailspec.demo.report import write_report
    from tailspec.demo.run import Demo
    from tailspec.tasks.policy import policy_meta, resolve_policy

    console = Console()
    cfg = config_from_args(args)
    opts = options_from_args(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo's own table is the progress display
    if opts.workers < 1 or opts.steps < 1:
        console.print("[red]--workers and --steps must be at least 1")
        return 2
    console.rule(f"[bold]tailspec demo — {opts.mode}")
    if not Path(opts.policy).is_dir():
        console.print(f"policy: the built-in {opts.policy} Llama pre-trained on the running-sum task "
                      "(built on first use, then cached)")
    path = resolve_policy(opts.policy, cfg.task, cache_dir=Path(cfg.cache_dir))
    m = policy_meta(path)
    if m:
        console.print(f"  {m['params']:,} params; accuracy {m['accuracy']:.1%} at temperature 1.0; response length "
                      f"p50 {m['len_p50']:.0f}, p90 {m['len_p90']:.0f}, p99 {m['len_p99']:.0f} tokens "
                      f"(p99/p50 = {m['len_p99'] / max(m['len_p50'], 1):.1f}: the long tail)")
    opts.policy = str(path)
    demo = Demo(opts, cfg)
    console.print(f"run directory: {demo.run_dir}")
    console.print(f"{opts.workers} rollout workers on [yellow]simulated[/] GPUs; telemetry is simulated from the "
                  "workers' own activity")

    table = Table(title="RL steps", expand=False)
    for col in ("step", "step s", "rollout s", "idle GPU·s", "lent GPU·s", "drafter", "acc.len", "acc co/frozen",
                "tok/s", "reward"):
        table.add_column(col, justify="right")
    status = {"text": "starting services…"}

    def render():
        from rich.console import Group
        from rich.text import Text

        return Group(table, Text(status["text"], style="dim"))

    with Live(render(), console=console, refresh_per_second=4, transient=False) as live:
        def on_progress(step, results):
            what = "engine warm-up (policy, drafter, cost model)" if step == "warm-up" else f"step {step}: rollout"
            status["text"] = f"{what} — {len(results)}/{opts.workers} workers done"
            live.update(render())

        def on_row(r):
            co = "-" if r.acceptance_cotrained is None else f"{r.acceptance_cotrained:.2f}"
            fr = "-" if r.acceptance_frozen is None else f"{r.acceptance_frozen:.2f}"
            table.add_row(str(r.step), f"{r.step_time_s:.1f}", f"{r.rollout_time_s:.1f}", f"{r.idle_gpu_seconds:.1f}",
                          f"{r.lent_gpu_seconds:.1f}", "-" if r.drafter_version is None else f"v{r.drafter_version}",
                          f"{r.acceptance_length:.2f}", f"{co}/{fr}", f"{r.rollout_tokens_per_s:.0f}",
                          f"{r.mean_reward:.2f}")
            status["text"] = f"step {r.step} done"
            live.update(render())

        status["text"] = "starting redis, scheduler, workers; training the first drafter (cached after the first run)…"
        live.update(render())
        rows = demo.run(on_row=on_row, on_progress=on_progress)
    meta = {"mode": opts.mode, "policy": opts.policy, "workers": opts.workers, "prompts_per_step": opts.prompts_per_step,
            "group_size": opts.group_size, "dashboard": demo.dashboard_url,
            "exported": demo.exported, "export_errors": demo.export_errors}
    report = write_report(demo.run_dir, [asdict(r) for r in rows], demo.timeline, meta)
    idle = sum(r.idle_gpu_seconds for r in rows)
    lent = sum(r.lent_gpu_seconds for r in rows)
    console.print(f"\nidle GPU-seconds {idle:.1f}, lent to drafter training {lent:.1f} "
                  f"(reclaimed share {lent / idle if idle else 0:.2f})")
    console.print(f"report: {report}")
    print(json.dumps({"run_dir": str(demo.run_dir), "steps": len(rows), "reclaimed_share": lent / idle if idle else 0}),
          file=sys.stdout)
    return 0
