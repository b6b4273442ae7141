"""Drafter trainer: acceptance before/after a training budget, throughput, stop latency, checkpoint time.

On the task policy (default `tiny`) and samples it generates at temperature 1 (cached next to the policy):
- `acceptance_before` / `acceptance_after`: expected acceptance length at k (default 4) on held-out samples,
  untrained drafter vs. after `--steps` optimizer steps (batch `trainer.batch_size`, TTT `trainer.ttt_length`);
- `train_tokens_per_s`: prompt+response tokens per second through teacher + drafter + optimizer;
- `stop_latency_p50_s` / `_p99_s`: stop request at a random moment → checkpoint whole, over `--stops` sessions;
- `checkpoint_save_s`: median time of one atomic checkpoint (drafter + optimizer);
- `reward_weighted_vs_uniform`: acceptance on the high-reward held-out samples of a drafter trained with
  reward weights vs. one trained with uniform weights, same data, seed and budget (`--compare-steps`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from tailspec.core.state import Sample

from tailspec.commands.args import config_from_args
from tailspec.tasks.samples import policy_samples


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="task policy preset (default tiny)")
    p.add_argument("--samples", type=int, default=800, help="rollout samples to generate (train + held out)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on generated response length")
    p.add_argument("--sample-seed", type=int, default=0, help="seed of the generated samples (cached per seed)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of the main training run")
    p.add_argument("--compare-steps", type=int, default=100, help="steps of each reward/uniform run (0 = skip)")
    p.add_argument("--stops", type=int, default=20, help="sessions stopped at random moments")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of every run (overrides trainer.lr)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")


def _trainer_cfg(args, ckdir: str, **kw):
    cfg = config_from_args(args).trainer
    return cfg.model_copy(update={"checkpoint_dir": ckdir, "lr": args.lr, **kw})


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser (torch alone is seconds of `tailspec
    # --help`); these load when the bench runs
    import torch
    from tailspec.drafter_trainer.teacher import Teacher

    torch.set_num_threads(args.threads)
    t0 = time.time()
    path, samples = policy_samples(args.preset, args.samples, seed=args.sample_seed,
                                   max_new_tokens=args.max_new_tokens)
    _log(f"policy {path.name}: {len(samples)} samples in {time.time() - t0:.1f}s, "
         f"mean reward {np.mean([s.reward for s in samples]):.3f}, "
         f"mean response {np.mean([len(s.response_ids) for s in samples]):.1f} tokens")
    teacher = Teacher.from_dir(path)
    with tempfile.TemporaryDirectory() as tmp:
        buf = _buffer(samples, "reward")
        main = _main_run(args, teacher, buf, tmp)
        latencies = _stop_latencies(args, teacher, buf, tmp)
        compare = _reward_vs_uniform(args, teacher, samples, buf, tmp) if args.compare_steps > 0 else None

    cfg, before, after = main.cfg, main.before, main.after
    lat = np.array(latencies)
    return {
        "bench": "trainer",
        "policy": path.name,
        "k": args.k,
        "steps": args.steps,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "ttt_length": cfg.ttt_length,
        "train_seconds": round(main.train_s, 2),
        "train_tokens_per_s": round(main.tokens / max(main.train_s, 1e-9), 1),
        "acceptance_before": round(before.acceptance_length, 4),
        "acceptance_after": round(after.acceptance_length, 4),
        "alpha_after": [round(a, 4) for a in after.alpha],
        "stop_latency_p50_s": round(float(np.percentile(lat, 50)), 4),
        "stop_latency_p99_s": round(float(np.percentile(lat, 99)), 4),
        "checkpoint_save_s": round(statistics.median(main.saves), 4),
        "reward_weighted_vs_uniform": compare,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "wall_s": round(time.time() - t0, 1),
    }


def _log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def _buffer(samples: list[Sample], mode: str):
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.drafter_trainer.samples import SampleBuffer

    buf = SampleBuffer(capacity=100_000, holdout_fraction=0.15, mode=mode)
    for s in samples:
        buf.add(s)
    return buf


@dataclass
class _MainRun:
    cfg: Any  # the trainer config of the run
    before: Any  # validation results (acceptance length, alpha) before and after training
    after: Any
    train_s: float
    tokens: int
    saves: list[float]  # seconds of each of 5 checkpoint saves


def _main_run(args: argparse.Namespace, teacher, buf, tmp: str) -> _MainRun:
    """--steps optimizer steps, validated on the held-out samples before and every 50 steps, then 5 saves timed."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.drafter_trainer.training_session import TrainingSession
    from tailspec.drafter_trainer.versions import validate

    holdout = list(buf.holdout)
    cfg = _trainer_cfg(args, f"{tmp}/main", weighting="reward")
    sess = TrainingSession(cfg, teacher, buf)
    before = validate(sess.drafter, teacher, holdout, args.k)
    _log(f"held out {len(holdout)} samples, {before.anchors} anchors; before: E={before.acceptance_length:.3f}")
    done, train_s, tokens = 0, 0.0, 0
    while done < args.steps:
        res = sess.run(max_steps=min(50, args.steps - done))
        done += res.steps
        train_s += res.train_seconds
        tokens += res.tokens
        mid = validate(sess.drafter, teacher, holdout, args.k)
        _log(f"step {sess.step}: loss {res.losses[-1]:.3f} acc/step {[round(a, 2) for a in res.step_accuracy]} "
             f"E={mid.acceptance_length:.3f} alpha={[round(a, 3) for a in mid.alpha]} "
             f"{tokens / max(train_s, 1e-9):.0f} tok/s")
    saves = []
    for _ in range(5):
        ts = time.perf_counter()
        sess.save()
        saves.append(time.perf_counter() - ts)
    sess.close()
    return _MainRun(cfg, before, mid, train_s, tokens, saves)


def _stop_latencies(args: argparse.Namespace, teacher, buf, tmp: str) -> list[float]:
    """--stops sessions, each asked to stop at a random moment: request -> checkpoint whole, in seconds."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.drafter_trainer.training_session import TrainingSession

    rng = random.Random(0)
    latencies = []
    for i in range(args.stops):
        s = TrainingSession(_trainer_cfg(args, f"{tmp}/stop{i}"), teacher, buf)
        timer = threading.Timer(rng.uniform(0.05, 1.5), s.request_stop, args=("bench",))
        timer.start()
        r = s.run(max_seconds=60)
        timer.join()
        latencies.append(r.stop_latency_s)
        s.close()
    _log(f"stop latency over {len(latencies)} sessions: max {max(latencies):.3f}s")
    return latencies


def _reward_vs_uniform(args: argparse.Namespace, teacher, samples: list[Sample], buf, tmp: str) -> dict:
    """A reward-weighted and a uniform drafter, same data, seed and budget, on the high-reward held-out samples."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.drafter_trainer.training_session import TrainingSession
    from tailspec.drafter_trainer.versions import validate

    holdout = list(buf.holdout)
    high = [s for s in holdout if s.reward >= 1.0]
    compare = {"high_reward_holdout_samples": len(high), "steps": args.compare_steps,
               "train_rewards_all_equal": len({s.reward for s in buf.train}) <= 1}
    if not high:  # no correct held-out sample (a weak policy): compare on all of them, and say so
        high = holdout
        compare["evaluated_on"] = "all held-out samples (none has reward 1)"
    for mode in ("reward", "uniform"):
        s = TrainingSession(_trainer_cfg(args, f"{tmp}/cmp-{mode}", weighting=mode), teacher, _buffer(samples, mode))
        s.run(max_steps=args.compare_steps)
        compare[mode] = validate(s.drafter, teacher, high, args.k).acceptance_length
        s.close()
    what = "held-out samples (none has reward 1)" if "evaluated_on" in compare else "high-reward held-out samples"
    _log(f"reward-weighted vs uniform on {len(high)} {what}: {compare}")
    return compare
