"""Where a cold long-tail rollout's time goes, step by step, on the rollout engine with its graph pool.

On the H200 (BENCHMARKS.md, third lease) the first step at a shape the process had not run before cost 60-150 ms
against 2-7 ms warm, with no SD as well as with EAGLE-3, and no eager fallback of the graph pool. This script
runs the same long tail cold and warm under fixed strategies, records every step (rows, k, the step record's
seconds, the whole `Engine.step` wall), and profiles the cold runs with `torch.profiler`: the ops whose self
time grows in the slow steps name the cost.

Usage (tailspec installed, not the source tree: run with `python -P`):
    python -P benchmarks/longtail_profile.py OUTDIR [--requests 64] [--max-tokens 512] [--ks 0,3]
Writes OUTDIR/steps.json (every step of every run) and OUTDIR/profile_k{K}.txt (the cold run's op table by
self CPU time, and by self device time on CUDA); prints a summary per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tailspec.benchmarks import adaptive as bench
from tailspec.rollout.sequence import SamplingParams
from tailspec.rollout.table_selector import fixed_selector

from tailspec.cli import build_parser
from tailspec.commands.args import config_from_args


def _timed_run(make_engine, k: int, prompts, params, profile: Path | None) -> dict:
    eng = make_engine(len(prompts), fixed_selector(k))
    steps: list[tuple[int, int, float, float]] = []
    step = eng.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        if eng.last is not None:
            steps.append((eng.last.rows, eng.last.k, eng.last.seconds, time.perf_counter() - t))
        return out

    eng.step = timed_step
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    if profile is None:
        eng.generate(prompts, params)
        wall = time.perf_counter() - t0
    else:  # profiled: slower throughout, but a step that is slow cold stands out all the same
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            eng.generate(prompts, params)
            wall = time.perf_counter() - t0
        table = prof.key_averages(group_by_input_shape=False).table(sort_by="self_cpu_time_total", row_limit=30)
        if torch.cuda.is_available():
            table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
        profile.write_text(table)
    median = statistics.median(s[3] for s in steps) if steps else 0.0
    slow = [s for s in steps if s[3] > 5 * median]
    return {"k": k, "wall_s": round(wall, 3), "steps": len(steps), "slow_steps": len(slow),
            "slow_s": round(sum(s[3] for s in slow), 3), "per_step": [[r, kk, round(a * 1e3, 3), round(w * 1e3, 3)]
                                                                   for r, kk, a, w in steps]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--ks", default="0,3")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= a.requests]
    args = build_parser().parse_args(["bench", "adaptive", "--batches", ",".join(map(str, batches))])
    cfg = config_from_args(args)
    target, tok, make_drafter, _, device = bench._load(args, cfg)
    graphs = device == "cuda" and cfg.rollout.cuda_graphs
    planned = {} if graphs else None
    make_engine = bench._engine_factory(target, make_drafter, cfg, 1024, 6, planned)
    ks = [int(x) for x in a.ks.split(",")]
    # the cost tables (and the graphs they plan) at the profiled k only: at all six k the two tables took 123 s of
    # a 180 s slot on an H100 (sixth lease), and the profiled runs never started
    table_ks = sorted(set(ks) | {0})
    bench._planned_cost_table(make_engine, planned, bench._prompts(tok, 256, 11, cfg.task), batches, table_ks,
                              max(table_ks), args, sys.stdout, time.perf_counter())
    prompts = bench._prompts(tok, a.requests, 12345, cfg.task)
    params = [SamplingParams(max_tokens=min(a.max_tokens, 1024 - len(q)), temperature=0.0, seed=i)
              for i, q in enumerate(prompts)]
    runs = []
    for k in ks:
        for label, prof in (("cold", out / f"profile_k{k}.txt"), ("warm", None)):
            r = _timed_run(make_engine, k, prompts, params, prof) | {"run": label}
            runs.append(r)
            print(f"k={k} {label}: {r['wall_s']} s, {r['steps']} steps, {r['slow_steps']} slow steps "
                  f"({r['slow_s']} s)", flush=True)
    (out / "steps.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
