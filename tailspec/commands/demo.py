"""`tailspec demo`: the main job on the built-in default.

A real GRPO loop on the tiny policy, rollouts on N simulated GPUs (worker processes running the adaptive
speculative engine), the scheduler lending the GPUs the long tail idles to drafter training, candidates
validated and promoted, workers loading the promoted drafter at the next phase, and at the end a run
directory with report.md, metrics.jsonl, plots and the exported drafter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tailspec.commands.args import add_config_args, config_from_args
from tailspec.demo.options import GPU_POLICY, DemoOptions, policy_for
from tailspec.demo.report import write_report
from tailspec.logs import FORMAT, RunLog, ours_or_warning


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="RL with long-tail rollouts, idle-GPU drafter co-training, export (the main job)")
    p.add_argument("--steps", type=int, default=DemoOptions.steps, help=f"RL steps (default {DemoOptions.steps})")
    p.add_argument("--workers", type=int, default=DemoOptions.workers,
                   help=f"simulated GPUs / rollout workers (default {DemoOptions.workers}; one per core, or two per "
                        "core under a CPU quota where one can be set)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-spec", action="store_true", help="baseline: plain decoding, no co-training")
    mode.add_argument("--frozen-drafter", action="store_true",
                      help="baseline: speculative decoding with the first drafter, never retrained")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default=None,
                   help=f"policy preset (micro|tiny|deep|small|gpu) or directory (default {DemoOptions.policy}; "
                        f"{GPU_POLICY} with --device cuda)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=DemoOptions.device,
                   help="where rollouts, sessions and the RL update run (default auto: CUDA where torch sees a "
                        "device). cuda: N simulated GPUs on this machine's devices, several to a device as shares "
                        "(CUDA MPS where it starts, else time-sliced; the run says which)")
    p.add_argument("--no-mps", action="store_true", help="with --device cuda: time-slice shared devices, no MPS")
    p.add_argument("--prompts", type=int, default=16, help="prompts per RL step (default 16)")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (GRPO group, default 4)")
    p.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a private redis-server")
    p.add_argument("--run-dir", metavar="DIR", help="default runs/<timestamp>")
    p.add_argument("--no-dashboard", action="store_true", help="do not serve the live web dashboard")
    p.add_argument("--bootstrap-steps", type=int, default=DemoOptions.bootstrap_steps,
                   help="optimizer steps of the first (offline) drafter, cached per policy "
                        f"(default {DemoOptions.bootstrap_steps})")
    p.add_argument("--bootstrap-seconds", type=float, default=DemoOptions.bootstrap_seconds,
                   help=f"cap on its training time (default {DemoOptions.bootstrap_seconds:g})")
    add_config_args(p)
    p.set_defaults(func=_demo)


def options_from_args(args: argparse.Namespace):
    mode = "nospec" if args.no_spec else "frozen" if args.frozen_drafter else "cotrained"
    return DemoOptions(steps=args.steps, workers=args.workers, mode=mode, seed=args.seed,
                       policy=policy_for(args.policy, args.device), device=args.device, mps=not args.no_mps,
                       prompts_per_step=args.prompts, group_size=args.group, redis_url=args.redis,
                       run_dir=Path(args.run_dir) if args.run_dir else None, dashboard=not args.no_dashboard,
                       bootstrap_steps=args.bootstrap_steps, bootstrap_seconds=args.bootstrap_seconds)


# The per-step table: two-line headers, no vertical rules and one space of padding, so that it fits an
# 80-column terminal with room to spare (75 columns with 3-digit steps, 5-digit tok/s); `step_table` is
# what the live display and the test render.
STEP_COLUMNS = ("step", "step\ns", "rollout\ns", "idle\nGPU·s", "lent\nGPU·s", "drafter", "acc.\nlen",
                "acc.\nco/frozen", "tok/s", "reward")
WIDTH = 80


def step_cells(r) -> list[str]:
    """One StepRow as the table's cells (same order as STEP_COLUMNS)."""
    co = "-" if r.acceptance_cotrained is None else f"{r.acceptance_cotrained:.2f}"
    fr = "-" if r.acceptance_frozen is None else f"{r.acceptance_frozen:.2f}"
    return [str(r.step), f"{r.step_time_s:.1f}", f"{r.rollout_time_s:.1f}", f"{r.idle_gpu_seconds:.1f}",
            f"{r.lent_gpu_seconds:.1f}", "-" if r.drafter_version is None else f"v{r.drafter_version}",
            f"{r.acceptance_length:.2f}", f"{co}/{fr}", f"{r.rollout_tokens_per_s:.0f}", f"{r.mean_reward:.2f}"]


def step_table(rows=()):
    table = Table(title="RL steps", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1))
    for col in STEP_COLUMNS:
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*step_cells(r))
    return table


def policy_line(policy: str, task_name: str) -> str:
    return f"policy: built-in {policy} Llama trained on the {task_name} task (built once, cached)"


def intro_lines(placement_note: str, meta: dict) -> list[str]:
    """What the run is, before it starts: short lines, each ending where it should on 80 columns."""
    lines = []
    if meta:
        lines.append(f"  {meta['params']:,} params; accuracy {meta['accuracy']:.1%} at temperature 1.0")
        lines.append(f"  response tokens p50 {meta['len_p50']:.0f}, p90 {meta['len_p90']:.0f}, p99 {meta['len_p99']:.0f}; "
                     f"p99/p50 = {meta['len_p99'] / max(meta['len_p50'], 1):.1f} (the long tail)")
    lines.append(f"rollout workers: {placement_note}")
    lines.append("GPU telemetry: [yellow]simulated[/] (from the workers' and sessions' activity)")
    return lines


class _ConsoleLog:
    """Log records through the rich console while the live table is up: printed above it, each on lines of
    their own (a plain stderr handler would write into the middle of the table's last line); like the CLI's
    console, only tailspec's records and other libraries' warnings (tailspec.logs.ours_or_warning)."""

    def __init__(self, console):
        class Handler(logging.Handler):
            def emit(self, record):
                try:
                    console.print(Text(self.format(record), style="dim"), overflow="fold")
                except Exception:  # noqa: BLE001 — logging's own contract: a record never breaks the run
                    self.handleError(record)

        self.handler = Handler()
        self.handler.setFormatter(logging.Formatter(FORMAT))
        self.handler.addFilter(ours_or_warning)
        self.saved: list = []

    def __enter__(self):
        root = logging.getLogger()
        self.saved = [h for h in root.handlers if type(h) is logging.StreamHandler]
        for h in self.saved:
            root.removeHandler(h)
        root.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        root = logging.getLogger()
        root.removeHandler(self.handler)
        for h in self.saved:
            root.addHandler(h)


@contextlib.contextmanager
def live_display(console: Console, render):
    """The live display of `render()` with log records above it, its last frame ending its line on exit: rich
    ends it only on a terminal, and in a file or a pipe the next line would continue it."""
    try:
        with Live(get_renderable=render, console=console, refresh_per_second=4, transient=False) as live, \
                _ConsoleLog(console):
            yield live
    finally:
        if not console.is_terminal:
            console.line()


def announcing_demo(opts, cfg, on_started):
    """A Demo that calls `on_started(demo)` as soon as its services are up (the live dashboard's address is
    known then), before the first drafter is trained and the first step runs."""
    # deferred: the RL loop loads torch and every component; the CLI imports every command to build its parser
    from tailspec.demo.run import Demo

    class AnnouncingDemo(Demo):
        def start_services(self) -> None:
            super().start_services()
            on_started(self)

    return AnnouncingDemo(opts, cfg)


def _demo(args: argparse.Namespace) -> int:
    # deferred: transformers (seconds of imports); the CLI imports every command to build its parser
    from transformers.utils import logging as hf_logging

    console = Console()
    cfg = config_from_args(args)
    opts = options_from_args(args)
    hf_logging.disable_progress_bar()  # the demo's own table is the progress display
    problem = _refused(opts, cfg)
    if problem:
        console.print(f"[red]{problem}")
        return 2
    # transformers' records through the root logger like every library's: the console's filter and the run log
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    with RunLog() as run_log:
        _demo_logged(console, cfg, opts, run_log)
    return 0


def _demo_logged(console: Console, cfg, opts, run_log: RunLog) -> None:
    """The demo with every log record kept for the run directory's demo.log (from before the directory is made)."""
    # deferred: torch and the models (seconds of imports); the CLI imports every command to build its parser
    from tailspec.demo.services import place_workers
    from tailspec.tasks.policy import policy_meta, resolve_policy

    console.rule(f"[bold]tailspec demo — {opts.mode}")
    if not Path(opts.policy).is_dir():
        console.print(policy_line(opts.policy, cfg.task.name), overflow="fold")
    path = resolve_policy(opts.policy, cfg.task, cache_dir=Path(cfg.cache_dir))
    placement = place_workers(opts.workers, cfg)
    opts.workers = placement.workers
    for line in intro_lines(placement.note, policy_meta(path)):
        console.print(line, overflow="fold")
    opts.policy = str(path)
    rows, demo = _run_live(console, opts, cfg, run_log)
    _summary(console, demo, opts, rows)


def _run_live(console: Console, opts, cfg, run_log: RunLog) -> tuple[list, Any]:
    """The demo run under the live step table and a status line below it; its rows and the demo."""
    table = step_table()
    status = {"text": "starting services…"}

    def render():
        return Group(table, Text(status["text"], style="dim", no_wrap=True, overflow="ellipsis"))

    def on_started(demo):
        if demo.dashboard_url:
            console.print(f"live dashboard: [bold]{demo.dashboard_url}[/] (while the run goes on)", overflow="fold")
        elif opts.dashboard:
            console.print("live dashboard: not started (see the log above)")
        status["text"] = ("loading the policy…" if opts.mode == "nospec" else
                          "training the first drafter (cached after the first run)…")

    demo = announcing_demo(opts, cfg, on_started)
    run_log.open(demo.run_dir / "demo.log")
    console.print(f"run directory: {demo.run_dir}", overflow="fold")

    with live_display(console, render) as live:
        def on_progress(step, results):
            what = "engine warm-up (policy, drafter, cost model)" if step == "warm-up" else f"step {step}: rollout"
            status["text"] = f"{what} — {len(results)}/{opts.workers} workers done"
            live.refresh()

        def on_row(r):
            table.add_row(*step_cells(r))
            status["text"] = f"step {r.step} done"
            live.refresh()

        status["text"] = "starting redis, the scheduler and the workers…"
        live.refresh()
        rows = demo.run(on_row=on_row, on_progress=on_progress)
    return rows, demo


def _refused(opts, cfg) -> str | None:
    """Why the demo cannot run these options (said before anything starts), or None."""
    if opts.workers < 1 or opts.steps < 1:
        return "--workers and --steps must be at least 1"
    if cfg.rollout.drafter == "draft_model":
        return ("rollout.drafter=draft_model: the demo has no draft model; use eagle3 (the co-trained drafter), "
                "ngram or none")
    return None


def _summary(console, demo, opts, rows) -> None:
    """The run's report file, its closing lines, and one JSON line on stdout for scripts."""
    meta = {"mode": opts.mode, "policy": opts.policy, "workers": opts.workers, "placement": demo.placement.note,
            "prompts_per_step": opts.prompts_per_step,
            "group_size": opts.group_size, "dashboard": demo.dashboard_url,
            "exported": demo.exported, "export_errors": demo.export_errors}
    report = write_report(demo.run_dir, [asdict(r) for r in rows], demo.timeline, meta)
    idle = sum(r.idle_gpu_seconds for r in rows)
    lent = sum(r.lent_gpu_seconds for r in rows)
    console.print(f"\nidle GPU-seconds {idle:.1f}, lent to drafter training {lent:.1f} "
                  f"(reclaimed share {lent / idle if idle else 0:.2f})")
    console.print(f"report: {report}", overflow="fold")
    print(json.dumps({"run_dir": str(demo.run_dir), "steps": len(rows), "reclaimed_share": lent / idle if idle else 0}),
          file=sys.stdout)
