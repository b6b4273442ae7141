"""Simulated GPUs as their own compute: a tail worker's decode speed with and without a drafter session training on another simulated GPU.

Two child processes, each pinned the way the demo pins them (scheduler/placement.py):
- the **tail worker** on simulated GPU 0: the rollout engine decoding small batches (a long tail's batch) of
  the task's prompts with the policy, answering "decode for S seconds" with the tokens it produced;
- the **session** on simulated GPU 1: a real drafter-training loop (teacher forward of the policy + the
  EAGLE-3 TTT step, `TrainingSession`) on the policy's own samples, paused (SIGSTOP) and resumed
  (SIGCONT) between windows, so every "with" window finds it mid-training, as a lent GPU's session is.

Windows alternate alone / with (A/B, `--repeats` pairs) so drift of the machine hits both alike; the figure is
the median over pairs of with ÷ alone. `--placement shared` runs the same without pinning (every process on
every core, the demo before cores were split), to show what the split buys.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from tailspec.benchmarks.machine import machine
from tailspec.core.config import TailspecConfig, TaskConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="deep", help="policy preset or directory (default deep: the demo's)")
    p.add_argument("--batch", type=int, default=4, help="tail worker's batch (default 4: a tail's few sequences)")
    p.add_argument("--window-s", type=float, default=4.0, help="seconds per measurement window (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="alone/with pairs (default 5)")
    p.add_argument("--placement", choices=("split", "quota", "shared", "both", "all", "demo"), default="all",
                   help="split: each simulated GPU on its own cores; quota: both GPUs on one core, half of it each "
                        "under a CPU quota (the demo's placement with more GPUs than cores, where a quota can be "
                        "set); shared: no pinning; both: split and shared; all (default): the three; demo: the "
                        "demo's 4 GPUs on this machine's cores (under quotas where they share), a session on each "
                        "of GPUs 1-3, as in a co-trained tail")
    p.add_argument("--child", choices=("decode", "train"), help=argparse.SUPPRESS)
    p.add_argument("--cpus", help=argparse.SUPPRESS)
    p.add_argument("--cgroup", help=argparse.SUPPRESS)


# -- children --------------------------------------------------------------------------------------------
def _decode_child(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import torch
    from tailspec.rollout.engine import Engine
    from tailspec.rollout.sequence import SamplingParams

    from tailspec.tasks.policy import load_policy, resolve_policy
    from tailspec.tasks.runsum import sample_problems
    from tailspec.tasks.tokenizer import encode_prompt

    torch.set_num_threads(len(os.sched_getaffinity(0)) if args.cpus else 1)
    model, tok = load_policy(resolve_policy(args.policy, TaskConfig()))
    prompts = [encode_prompt(tok, p.prompt) for p in sample_problems(256, TaskConfig(), seed=5)]
    engine = Engine(model, None, max_batch=args.batch, max_seq_len=640, seed=0)
    i = 0

    def batch():
        nonlocal i
        ps = [prompts[(i + j) % len(prompts)] for j in range(args.batch)]
        i += args.batch
        # a fixed length per request, so every window decodes the same mix of batch sizes
        return ps, [SamplingParams(max_tokens=96, temperature=1.0, seed=i + j, ignore_eos=True) for j in range(len(ps))]

    engine.generate(*batch())  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        seconds = float(line)
        t0 = time.perf_counter()
        tokens = 0
        while time.perf_counter() - t0 < seconds:
            tokens += sum(len(o.token_ids) for o in engine.generate(*batch()))
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0}), flush=True)
    return 0


def _train_child(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import torch
    from tailspec.drafter_trainer.samples import fill_buffer
    from tailspec.drafter_trainer.teacher import Teacher
    from tailspec.drafter_trainer.training_session import TrainingSession

    from tailspec.demo.bootstrap import rollout_samples
    from tailspec.session_entry import make_buffer
    from tailspec.tasks.policy import resolve_policy

    torch.set_num_threads(len(os.sched_getaffinity(0)) if args.cpus else 1)
    cfg = TailspecConfig()
    cfg.trainer.batch_size = 8  # the demo's session batch
    path = resolve_policy(args.policy, cfg.task)
    samples = rollout_samples(path, cfg, 32, seed=1)
    teacher = Teacher.from_dir(path)
    buffer = make_buffer(cfg)
    fill_buffer(buffer, samples, teacher.config.vocab_size, cfg.trainer.max_seq_len)
    with tempfile.TemporaryDirectory(prefix="tailspec-isolation-") as tmp:
        session = TrainingSession(cfg.trainer, teacher, buffer, checkpoint_dir=tmp)
        session.run(max_steps=2)
        print(json.dumps({"ready": True}), flush=True)
        session.run(max_seconds=24 * 3600.0)  # until the parent kills it
    return 0


# -- parent ----------------------------------------------------------------------------------------------
def _spawn(kind: str, args: argparse.Namespace, cpus: list[int] | None, cgroup: str | None = None) -> subprocess.Popen:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.placement import format_cpus

    cmd = [sys.executable, "-m", "tailspec.benchmarks.isolation", "--child", kind, "--policy", args.policy,
           "--batch", str(args.batch)]
    if cpus is not None:
        cmd += ["--cpus", format_cpus(cpus)]  # the child pins itself, as demo workers and sessions do
    if cgroup is not None:
        cmd += ["--cgroup", cgroup]  # ... and joins its GPU's CPU quota
    env = dict(os.environ, OMP_NUM_THREADS=str(len(cpus) if cpus else 1), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        proc.kill()
        raise RuntimeError(f"isolation bench: the {kind} child did not start (exit {proc.poll()})")
    return proc


def _window(decoder: subprocess.Popen, seconds: float) -> float:
    decoder.stdin.write(f"{seconds}\n")
    decoder.stdin.flush()
    r = json.loads(decoder.stdout.readline())
    return r["tokens"] / r["seconds"]


def _measure(args: argparse.Namespace, mode: str, out) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler import cpu_quota, placement

    cgroups: list = [None, None]
    quota: float | list[float] | None = None  # each GPU's share of its cores (None: whole cores or no pinning)
    if mode == "quota":  # GPUs 0 and 1 on one core, half of it each (placement.shares with a quota)
        cpus = [s.cpus for s in placement.shares(2, placement.host_cpus()[:1], quota=True)]
        cgroups = [cpu_quota.create(cpu_quota.name_for(f"isolation-{os.getpid()}", g), 0.5) for g in (0, 1)]
        quota = 0.5
    elif mode == "demo":  # the demo's 4 GPUs as it places them here: whole cores, or quotas where cores are few
        can_quota = cpu_quota.root()[0] is not None
        got = placement.shares(placement.gpus_that_fit(4, quota=can_quota), quota=can_quota)
        cpus = [s.cpus for s in got]
        cgroups = [cpu_quota.create(cpu_quota.name_for(f"isolation-{os.getpid()}", g), s.fraction)
                   if s.fraction < 1.0 else None for g, s in enumerate(got)]
        quota = [s.fraction for s in got]
    else:
        cpus = placement.split(2) if mode == "split" else [None, None]
    try:
        return {"quota": quota, **_pairs(args, mode, cpus, cgroups, out)}
    finally:
        for cg in cgroups:
            if cg is not None:
                cpu_quota.remove(cg)


def _pairs(args: argparse.Namespace, mode: str, cpus: list, cgroups: list, out) -> dict:
    """The decoder on GPU 0, a session on every other GPU in `cpus`; alone / with windows in turn."""
    decoder = _spawn("decode", args, cpus[0], cgroups[0])
    trainers = [_spawn("train", args, c, g) for c, g in zip(cpus[1:], cgroups[1:])]
    others = "the other GPU" if len(trainers) == 1 else f"each of the {len(trainers)} other GPUs"

    def signal_all(sig: int) -> None:
        for t in trainers:
            os.kill(t.pid, sig)

    signal_all(signal.SIGSTOP)
    alone, with_, ratios = [], [], []
    try:
        for i in range(args.repeats):
            a = _window(decoder, args.window_s)
            signal_all(signal.SIGCONT)
            time.sleep(0.2)  # the sessions are mid-step when the window opens
            w = _window(decoder, args.window_s)
            signal_all(signal.SIGSTOP)
            alone.append(a)
            with_.append(w)
            ratios.append(w / a)
            print(f"  {mode} pair {i + 1}/{args.repeats}: alone {a:.0f} tok/s, "
                  f"with a session on {others} {w:.0f} tok/s ({w / a:.3f})", file=out, flush=True)
    finally:
        signal_all(signal.SIGCONT)
        for t in trainers:
            t.kill()
        decoder.stdin.close()
        decoder.wait(timeout=30)
        for t in trainers:
            t.wait(timeout=30)
    ratio = statistics.median(ratios)
    return {"cpus": cpus if mode != "shared" else "shared", "sessions": len(trainers),
            "alone_tok_s": [round(x, 1) for x in alone],
            "with_session_tok_s": [round(x, 1) for x in with_], "ratios": [round(x, 4) for x in ratios],
            "with_over_alone": round(ratio, 4), "slowdown": round(1 - ratio, 4)}


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler import placement

    out = sys.stderr if args.json else sys.stdout
    host = placement.host_cpus()
    result: dict = {"device": machine(), "policy": args.policy, "batch": args.batch, "window_s": args.window_s,
                    "repeats": args.repeats, "host_cpus": host}
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler import cpu_quota

    modes = {"both": ("split", "shared"), "all": ("split", "quota", "shared")}.get(args.placement, (args.placement,))
    if "split" in modes and len(host) < 2:
        print(f"isolation: {len(host)} core: two simulated GPUs cannot each own one; split skipped", file=out)
        modes = tuple(m for m in modes if m != "split")
    if "quota" in modes and cpu_quota.root()[0] is None:
        print(f"isolation: no CPU quota here ({cpu_quota.root()[1]}); quota skipped", file=out)
        modes = tuple(m for m in modes if m != "quota")
    print(f"bench isolation: policy={args.policy} batch={args.batch} {args.repeats} x ({args.window_s:.0f} s alone, "
          f"{args.window_s:.0f} s with a session) on {len(host)} cores", file=out, flush=True)
    for m in modes:
        result[m] = _measure(args, m, out)
    for m in modes:
        r = result[m]
        print(f"{m}: tail worker with a session training on {'each other' if r['sessions'] > 1 else 'the other'} "
              f"simulated GPU ({r['sessions']}) runs at "
              f"{r['with_over_alone']:.3f} x its speed alone (slowdown {r['slowdown']:.1%}; target ≤ 5% split "
              "and quota)", file=out)
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args()
    if args.cgroup:
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        from tailspec.scheduler import cpu_quota

        cpu_quota.join(args.cgroup)
    if args.cpus:
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        from tailspec.scheduler.placement import parse_cpus, pin

        pin(parse_cpus(args.cpus))
    return _decode_child(args) if args.child == "decode" else _train_child(args)


if __name__ == "__main__":
    sys.exit(main())
