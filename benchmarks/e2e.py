"""End-to-end benchmark: the demo's RL loop run three ways with the same seeds (no SD; SD with a frozen drafter; SD with co-training).

Defaults are the demo's (`tailspec demo`): the deep policy, its EAGLE-3 drafter, one simulated GPU per core
up to 4. Step times are means over the steps after the first (`--skip-first`); `speedup_vs_frozen_last_third`
compares the last third of the steps, where a frozen drafter is stalest.

Paired by design: under the demo's verify rule (`rollout.verify_rule` coupled) the three modes decode the same
tokens while their policies agree, and the modes run in lockstep — step i of each (in rotating order) before
step i+1 of any — so a shared machine's load drifts over all three alike instead of landing on one mode's run.
The co-trained mode's workers start from the frozen mode's warm-up cost tables (`--own-cost-tables`: each mode
times its own): the two modes run the same engines on the same simulated GPUs, and a table timed in 3 steps per
entry on a share of a core differs between two timings by more than the strategies it ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from tailspec.benchmarks.machine import machine
from tailspec.commands.args import config_from_args
from tailspec.demo.options import GPU_POLICY, DemoOptions, policy_for
from tailspec.demo.report import lent_in_tail, session_split, tail_idle_share
from tailspec.tasks.runsum import sample_problems


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoOptions()
    p.add_argument("--steps", type=int, default=d.steps, help=f"RL steps per run (default {d.steps}, the demo's)")
    p.add_argument("--workers", type=int, default=d.workers,
                   help=f"simulated GPUs (default {d.workers}; one per core, or two per "
                        "core under a CPU quota where one can be set)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--policy", default=None,
                   help=f"policy preset or directory (default {d.policy}; {GPU_POLICY} with --device cuda)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device,
                   help="where the three runs' rollouts, sessions and updates run (default auto: CUDA where torch "
                        "sees a device); cuda: the simulated GPUs are devices or shares of one (MPS where it starts, "
                        "else time-sliced), one plan for all three modes")
    p.add_argument("--no-mps", action="store_true", help="with --device cuda: time-slice a shared device, no MPS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-first", type=int, default=1,
                   help="steps left out of the step-time mean (default 1: the first runs on cold caches; the engines' "
                        "warm-up runs before step 0 and is in no step)")
    p.add_argument("--bootstrap-samples", type=int, default=d.bootstrap_samples,
                   help=f"the first drafter's rollouts (default {d.bootstrap_samples}, the demo's)")
    p.add_argument("--bootstrap-steps", type=int, default=d.bootstrap_steps,
                   help=f"the first drafter's optimizer steps (default {d.bootstrap_steps}, the demo's)")
    p.add_argument("--own-cost-tables", action="store_true",
                   help="each mode's workers keep the cost tables they time at warm-up (default: the co-trained "
                        "mode starts from the frozen mode's, on the same simulated GPUs, so the two modes' strategy "
                        "choices differ by their drafters, not by two noisy timings of one machine)")
    p.add_argument("--out", metavar="DIR", help="keep the three run directories here (default: a temp dir)")


def run(args: argparse.Namespace) -> dict:
    cfg = config_from_args(args)
    out = print_to = sys.stderr if args.json else sys.stdout
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="tailspec-bench-e2e-")
    root = Path(args.out or tmp.name)
    runs, demos = _run_modes(args, cfg, root, out, print_to)
    step = {m: _mean_after(rows, "step_time_s", args.skip_first) for m, rows in runs.items()}
    result = _result(args, runs, demos, step)
    result.update(drafter_cost_ratio(demos["cotrained"]))
    print(f"step time (mean, steps {args.skip_first}+): " +
          ", ".join(f"{m} {v:.1f}s" for m, v in step.items()) +
          f"; co-trained speedup {result['speedup_vs_nospec']['cotrained']:.2f}x, frozen "
          f"{result['speedup_vs_nospec']['frozen']:.2f}x; co-trained / frozen over the last third "
          f"{result['speedup_vs_frozen_last_third']:.2f}x; reclaimed share {result['reclaimed_share']:.2f} "
          f"(of the tail on the workers' clocks {result['reclaimed_share_of_tail']:.2f}); "
          f"{result['promotions']} promotions; tail idle share {result['tail_idle_share']:.2f}; "
          f"drafter step / target forward {result['drafter_cost_ratio']}", file=out)
    print("a step's seconds (mean): " + "; ".join(
        f"{m} rollout {result['rollout_time_s'][m]:.2f} (slowest worker: setup {t['setup']:.2f}, decode "
        f"{t['decode']:.2f}, other {t['other']:.2f}) + update {result['update_time_s'][m]:.2f}"
        for m, t in result["tail_worker_s"].items()), file=out)
    first, last = result["acceptance_first_last"]["frozen"]
    if first is not None and last is not None:
        print(f"frozen drafter on each step's samples: {first:.2f} -> {last:.2f} "
              f"({result['frozen_acceptance_change']:+.1%}); alternative style share "
              f"{runs['frozen'][0].alt_style_share:.2f} -> {runs['frozen'][-1].alt_style_share:.2f}, accuracy "
              f"{runs['frozen'][0].accuracy:.2f} -> {runs['frozen'][-1].accuracy:.2f}", file=out)
    split = result["lent_split_gpu_seconds"]
    print(f"idle GPU-s that became training steps: {result['training_share']:.2f} (lent {result['lent_gpu_seconds']:.1f}"
          f": training {split['train']:.1f} (waiting in rounds {split.get('wait', 0.0):.1f}), validating "
          f"{split['validate']:.1f}, start-up {split['ready']:.1f}, "
          f"merges and stops {split['other']:.1f})", file=out)
    same = result["responses_identical_to_nospec"]
    print(f"verify rule {result['verify_rule']}; steps whose responses are no SD's, token for token: frozen "
          f"{same['frozen']:.0%}, co-trained {same['cotrained']:.0%}", file=out)
    if tmp is not None:
        tmp.cleanup()
    return result


MODES = ("nospec", "frozen", "cotrained")


def _run_modes(args: argparse.Namespace, cfg, root: Path, out, print_to) -> tuple[dict, dict]:
    """The demo's RL loop with no SD, a frozen drafter and co-training, same seeds, in lockstep (module
    docstring): each mode's rows and demo. Each demo's services stay up between its own steps, idle."""
    # deferred: the RL loop loads torch and every component; the CLI imports every bench module to build its parser
    from tailspec.demo.device_share import share_devices
    from tailspec.demo.run import Demo
    from tailspec.demo.services import resolve_device

    demos = {}
    device = resolve_device(args.device)
    with contextlib.ExitStack() as stack:
        # one plan of the simulated GPUs on the device(s), and one MPS daemon, for the three modes alike
        shares = share_devices(args.workers, mps=not args.no_mps) if device == "cuda" else None
        if shares is not None:
            stack.callback(shares.stop)
        for mode in MODES:
            shared = mode == "cotrained" and not args.own_cost_tables
            opts = DemoOptions(steps=args.steps, workers=args.workers, mode=mode, seed=args.seed,
                               policy=policy_for(args.policy, device), device=device,
                               prompts_per_step=args.prompts, group_size=args.group, run_dir=root / mode,
                               dashboard=False, export=False, bootstrap_samples=args.bootstrap_samples,
                               bootstrap_steps=args.bootstrap_steps,
                               cost_tables=(demos["frozen"].cost_tables or None) if shared else None)
            demo = demos[mode] = Demo(opts, cfg, shares)
            stack.enter_context(demo.opened())
            print(f"== {mode}: {args.steps} steps; {demo.placement.note}", file=out)
        for step in range(args.steps):
            for mode in MODES[step % 3:] + MODES[: step % 3]:
                demos[mode].record(demos[mode].step(step), on_row=lambda r: print(
                    f"  {r.mode:9s} step {r.step}: {r.step_time_s:.1f}s (rollout {r.rollout_time_s:.1f}s) acc.len "
                    f"{r.acceptance_length:.2f} idle {r.idle_gpu_seconds:.1f} lent {r.lent_gpu_seconds:.1f} reward "
                    f"{r.mean_reward:.2f} acc {r.accuracy:.2f} alt {r.alt_style_share:.2f}"
                    + (f" frozen {r.acceptance_frozen:.2f}" if r.acceptance_frozen is not None else ""), file=print_to))
    return {m: d.rows for m, d in demos.items()}, demos


def _mean_after(rows, attr: str, skip_first: int) -> float:
    # The mean, not the median: the three runs share seeds, so step i does the same work in every mode
    # and the means compare the same total work; steps differ a lot in length (the long tail), and a
    # median picks a different step in each mode.
    xs = [getattr(r, attr) for r in rows[skip_first:]] or [getattr(r, attr) for r in rows]
    return statistics.fmean(xs)


def _lending(co: list, timeline: list[dict]) -> dict:
    """The co-trained run's lending: the scheduler's counters (its idle count starts when it sees a drain) and the
    same on the workers' clocks (lent GPU-s inside each worker's idle tail ÷ the tail's idle GPU-s)."""
    idle = sum(r.idle_gpu_seconds for r in co)
    lent = sum(r.lent_gpu_seconds for r in co)
    tail_lent, tail_idle = lent_in_tail([asdict(r) for r in co], timeline)
    split = session_split([asdict(r) for r in co])
    return {
        # the goal's figure: idle GPU-seconds that became drafter training (whole optimizer steps), not just lent
        "training_share": round(split["train"] / idle, 3) if idle else 0.0,
        "lent_split_gpu_seconds": {k: round(v, 2) for k, v in split.items()},
        "reclaimed_share": round(lent / idle, 3) if idle else 0.0,
        "reclaimed_share_of_tail": round(tail_lent / tail_idle, 3) if tail_idle else 0.0,
        "idle_gpu_seconds": round(idle, 2),
        "lent_gpu_seconds": round(lent, 2),
        "tail_idle_gpu_seconds": round(tail_idle, 2),
        "tail_lent_gpu_seconds": round(tail_lent, 2),
    }


def _result(args: argparse.Namespace, runs: dict, demos: dict, step: dict[str, float]) -> dict:
    """The bench's JSON; `step`: each mode's mean step time over the steps after --skip-first."""

    third = max(1, len(runs["frozen"]) // 3)
    last_third = {m: statistics.fmean(r.step_time_s for r in rows[-third:]) for m, rows in runs.items()}
    wall = {m: sum(r.step_time_s + r.measure_s for r in rows) for m, rows in runs.items()}
    measured = {m: sum(r.measure_s for r in rows) for m, rows in runs.items()}
    rollout = {m: _mean_after(rows, "rollout_time_s", args.skip_first) for m, rows in runs.items()}
    co, fr = runs["cotrained"], runs["frozen"]
    placement = demos["cotrained"].placement
    return {
        "device": machine(),
        "policy": demos["cotrained"].o.policy,
        "steps": args.steps,
        "workers": placement.workers,
        "placement": {"note": placement.note, "cpus": placement.cpus, "device": placement.device},
        "step_time_s": {m: round(v, 3) for m, v in step.items()},  # mean over steps skip_first+
        "step_times_s": {m: [round(r.step_time_s, 3) for r in rows] for m, rows in runs.items()},
        "rollout_time_s": {m: round(v, 3) for m, v in rollout.items()},
        "speedup_vs_nospec": {m: round(step["nospec"] / step[m], 3) for m in ("frozen", "cotrained")},
        "speedup_vs_frozen_last_third": round(last_third["frozen"] / last_third["cotrained"], 3),
        "last_third_step_time_s": {m: round(v, 3) for m, v in last_third.items()},
        "rollout_speedup_vs_nospec": {m: round(rollout["nospec"] / rollout[m], 3) for m in ("frozen", "cotrained")},
        # where a step's seconds go: the update (grade, reclaim wait, GRPO, publish) and the slowest worker's rollout
        "update_time_s": {m: round(_mean_after(rows, "train_time_s", args.skip_first), 3) for m, rows in runs.items()},
        "tail_worker_s": {m: _tail_split(rows[args.skip_first:] or rows) for m, rows in runs.items()},
        "acceptance_first_last": {
            "frozen": [fr[0].acceptance_frozen, fr[-1].acceptance_frozen],
            "cotrained": [co[0].acceptance_cotrained, co[-1].acceptance_cotrained],
        },
        "frozen_on_cotrained_samples_first_last": [co[0].acceptance_frozen, co[-1].acceptance_frozen],
        # the drift: the frozen drafter's acceptance on each step's own samples, last ÷ first − 1 (frozen run)
        "frozen_acceptance_change": relative_change(fr[0].acceptance_frozen, fr[-1].acceptance_frozen),
        "acceptance_curves": {
            "frozen": {r.step: r.acceptance_frozen for r in fr if r.acceptance_frozen is not None},
            "cotrained": {r.step: r.acceptance_cotrained for r in co if r.acceptance_cotrained is not None},
        },
        "promotions": demos["cotrained"].promotions,
        "drafter_versions": [r.drafter_version for r in co],
        # the long tail: GPU-seconds a worker sat drained while another decoded, ÷ workers x rollout time
        "tail_idle_share": round(tail_idle_share([asdict(r) for rows in runs.values() for r in rows]), 3),
        "tail_idle_share_by_mode": {m: round(tail_idle_share([asdict(r) for r in rows]), 3) for m, rows in runs.items()},
        # instrumentation (logprob check, acceptance of both drafters) ÷ the run's wall time over its steps
        "instrumentation_share": {m: round(measured[m] / wall[m], 3) if wall[m] else 0.0 for m in runs},
        **_lending(co, demos["cotrained"].timeline),
        "reward_final": {m: rows[-1].mean_reward for m, rows in runs.items()},
        "reward_curves": {m: [r.mean_reward for r in rows] for m, rows in runs.items()},
        "accuracy_curves": {m: [round(r.accuracy, 3) for r in rows] for m, rows in runs.items()},
        # share of responses in the task's alternative style, which the reward's style bonus favours
        "alt_style_curves": {m: [round(r.alt_style_share, 3) for r in rows] for m, rows in runs.items()},
        "reward_agreement": reward_agreement(runs, args.prompts * args.group),
        "verify_rule": demos["cotrained"].cfg.rollout.verify_rule,
        "cost_tables": "own" if args.own_cost_tables else "frozen mode's, shared with co-trained",
        # steps whose responses are token for token no SD's (the coupled rule pairs the modes: while the policies
        # agree, every mode decodes the same rollouts and only the time differs)
        "responses_identical_to_nospec": identical_steps(runs),
        "logprob_max_abs_diff": max(r.logprob_max_abs_diff for rows in runs.values() for r in rows),
    }


def _tail_split(rows) -> dict[str, float]:
    """Mean over `rows` of the step's slowest worker's seconds: setup (policy and drafter load, engine), decode
    (its decode steps) and the rest (prefill, progress reports, handing results out); speculation shortens only
    the decode."""
    split = {"setup": 0.0, "decode": 0.0, "other": 0.0}
    for r in rows:
        w = max(r.worker_busy_s, key=r.worker_busy_s.get)
        setup, decode = r.worker_setup_s.get(w, 0.0), r.worker_decode_s.get(w, 0.0)
        for k, v in (("setup", setup), ("decode", decode), ("other", r.worker_busy_s[w] - setup - decode)):
            split[k] += v / len(rows)
    return {k: round(v, 3) for k, v in split.items()}


def relative_change(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None or first == 0 else round(last / first - 1, 4)


def drafter_cost_ratio(demo) -> dict:
    """One EAGLE-3 drafter step ÷ one target forward at batch 1 (`tailspec bench engine`'s timing) for the
    run's policy and first drafter: the miniature's cost ratio, which a GPU deployment's is a few percent."""
    if demo.frozen_path is None:
        return {"drafter_cost_ratio": None}
    # deferred: torch and the models; the CLI imports every bench module to build its parser
    import torch
    from tailspec.benchmarks.engine import drafter_cost
    from tailspec.drafter_trainer.model import Eagle3Module

    from tailspec.tasks.tokenizer import encode_prompt

    threads = torch.get_num_threads()
    torch.set_num_threads(len(demo.placement.cpus[0]) if demo.placement.cpus else 1)  # a worker's cores
    try:
        eagle = Eagle3Module.load(demo.frozen_path, demo.model.get_input_embeddings()).eval()
        prompts = [encode_prompt(demo.tokenizer, p.prompt) for p in sample_problems(16, seed=30_000)]
        per = drafter_cost(demo.model.eval(), eagle, [1], prompts, repeats=3)
    finally:
        torch.set_num_threads(threads)
    return {"drafter_cost_ratio": round(per[1]["ratio"], 4)}


def identical_steps(runs: dict) -> dict[str, float]:
    """Per mode, the share of steps whose responses are token for token no SD's (StepRow.responses_digest)."""
    base = [r.responses_digest for r in runs["nospec"]]
    return {m: round(statistics.fmean(a == r.responses_digest for a, r in zip(base, rows)), 3) if rows else 0.0
            for m, rows in runs.items() if m != "nospec"}


def reward_agreement(runs: dict, n: int) -> dict:
    """Do the modes' reward curves agree within seed noise? Under the coupled rule the modes decode the same
    responses while their policies agree, so the gap is 0; under the residual rule each step's responses are
    other draws from the same policy (speculation draws other random numbers). The test: at
    every step, |mean reward of a mode − no SD's| ≤ 2 standard errors of the difference of two means of n
    rewards in [0, 1], each with variance at most p(1 − p) (p: the two modes' pooled mean; reward here is
    0/1, so this is the binomial bound). Returns the largest gap, its bound, and whether every step holds."""
    base = runs["nospec"]
    worst, bound_at, ok = 0.0, 0.0, True
    for m in ("frozen", "cotrained"):
        for a, b in zip(base, runs[m]):
            p = (a.mean_reward + b.mean_reward) / 2
            bound = 2 * math.sqrt(2 * max(p * (1 - p), 1e-4) / n)
            gap = abs(a.mean_reward - b.mean_reward)
            ok &= gap <= bound
            if gap > worst:
                worst, bound_at = gap, bound
    return {"max_gap": round(worst, 4), "bound_2se": round(bound_at, 4), "within_noise": ok}
