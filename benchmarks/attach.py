"""attach: TRL's GRPOTrainer with and without tailspec attached, same seeds (overhead, idle, reclaim, wait).

Runs `tailspec.integrations.trl_example` under torchrun (one rank per simulated GPU, each pinned to its GPU's
share of the cores) three times with the same seed: unattached; attached with the scheduler lending drained
GPUs to drafter-training sessions; attached with lending off (the hooks, policy publishing and the
reclaim wait alone); `--repeats` times, each repeat running the three in turn in an order rotated by the repeat
(default 3: one run's step time moves ±10% on this machine).
Figures:
- `attach_overhead`: the median over repeats of mean optimizer-step time attached (lending on) / unattached − 1
  within the repeat (`attach_overhead_runs`: each repeat's). On simulated GPUs a lent session computes on its
  GPU's cores, which the waiting rank shares; on real GPUs it would not;
- `attach_overhead_no_lend`: the same with lending off;
- `idle_gpu_seconds`, `lent_gpu_seconds`, `reclaimed_share` (lent / idle): the scheduler's counters over the
  attached runs;
- `wait_reclaimed_p99_s`: the 99th percentile of `wait_reclaimed` over every rank's steps;
- `loss_curves_equal`: TRL's logged losses attached and unattached are identical;
- `renewal_share_of_session_step`: the sessions' lease renewal threads' CPU time over their training steps' time;
- `overhead_breakdown_lend`, `overhead_breakdown_no_lend`: per optimizer step, the overhead beside the attachment's
  time on the trainer threads by cause and the host CPU beside the ranks (benchmarks/attach_costs.py);
- `wait_reclaimed_parts`: the waits that had a session to stop, split at the scheduler's revoke and the session's
  release (median and max of each part).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tailspec.benchmarks.attach_costs import (
    breakdown,
    descendants,
    host_cpu,
    parts_summary,
    reclaim_parts,
    trainer_seconds,
)
from tailspec.benchmarks.machine import machine
from tailspec.core import state
from tailspec.core.config import TailspecConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=6, help="GRPO optimizer steps per run")
    p.add_argument("--ranks", type=int, default=2, help="trainer processes (one simulated GPU each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", choices=["task", "tails"], default="tails")
    p.add_argument("--policy", default="tiny")
    p.add_argument("--redis", default=None, help="Redis URL (default: a private redis-server)")
    p.add_argument("--repeats", type=int, default=3,
                   help="unattached / lending on / lending off, this many times in turn (one run spans ±10%% here)")


def scheduler_config(url: str, cluster: str, shared: Path, gpus: int, lend: bool = True) -> TailspecConfig:
    """A single-node scheduler on simulated GPUs, sessions warm, lending at once: the miniature's settings."""
    return TailspecConfig.model_validate({
        "cluster": {"name": cluster, "redis_url": url},
        "scheduler": {"telemetry": "simulated", "simulated_gpus": gpus, "warm_sessions": gpus, "lend": lend,
                      "idle_window_s": 0.05, "session_startup_s": 0.0,
                      "lease_ttl_s": 5.0},
        "trainer": {"checkpoint_dir": str(shared / "drafter"), "batch_size": 4, "merge_every_steps": 2},
    })


@contextmanager
def local_scheduler(cfg: TailspecConfig, log_dir: Path, warm_timeout_s: float = 180.0) -> Iterator[None]:
    """`run_local` in a thread; returns once its warm session processes have finished importing."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.dispatch import warm_ready
    from tailspec.scheduler.service import run_local

    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop, cfg.cluster.redis_url, str(log_dir)), daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + warm_timeout_s
        while warm_ready(log_dir) < cfg.scheduler.warm_sessions:
            if time.monotonic() > deadline or not th.is_alive():
                raise RuntimeError(f"the scheduler's warm sessions did not start (see {log_dir})")
            time.sleep(0.1)
        yield
    finally:
        stop.set()
        th.join(30)


def run_trl(out: Path, *, ranks: int, steps: int, seed: int, dataset: str, policy: str, url: str | None = None,
            cluster: str = "default", shared: Path | None = None, timeout_s: float = 600.0,
            prepare_policy: bool = True) -> list[dict]:
    """One torchrun of the TRL recipe (attached when `url` is given); each rank's JSON summary, rank 0 first.

    `prepare_policy`: a preset policy missing from the cache is built here, once, before the ranks start and outside
    `timeout_s` (minutes of pre-training on 2 cores), as the recipe's `--build-policy` does; the ranks then only load
    it.

    Past `timeout_s` the whole process group (launcher and ranks) is killed and the error carries the log's
    tail, where every rank printed its stacks shortly before (--stack-dump-after): a hang names its place.
    A run whose every rank wrote its summary but did not exit within TEARDOWN_GRACE_S is killed and its summaries
    used, with a warning: on a loaded machine a rank has hung in interpreter teardown (no Python frame left,
    a native destructor) after its work was done and written. So are the summaries of a run that crashed there
    (a rank aborted after the last summary was written)."""
    if prepare_policy:
        build_policy(policy)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(_free_port()), "-m", "tailspec.integrations.trl_example", "--steps", str(steps), "--seed", str(seed),
           "--dataset", dataset, "--policy", policy, "--pin-cores", "--out", str(out),
           "--stack-dump-after", str(max(1.0, timeout_s - 15.0))]
    cmd += ["--redis", url, "--cluster", cluster, "--shared-dir", str(shared)] if url else ["--no-tailspec"]
    log = out.with_suffix(".log")
    paths = [out] + [out.with_name(f"{out.stem}.rank{r}{out.suffix}") for r in range(1, ranks)]
    for p in paths:
        p.unlink(missing_ok=True)  # a summary left by an earlier run must not count as this one's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rc = _wait(proc, paths, timeout_s, log)
    if rc != 0:
        done = _summaries(paths)
        if done is None:
            raise RuntimeError(f"TRL run failed (exit {rc}); last lines of {log}:\n{_tail(log, 30)}")
        # every rank wrote its whole summary (its last act) before a rank died: a crash in interpreter teardown
        # (a native destructor: "terminate called without an active exception", SIGABRT), after the work was done
        print(f"warning: the run exited {rc} after every rank had written its summary (a crash in teardown); "
              f"summaries used. Log: {log}", file=sys.stderr)
        return done
    return [json.loads(p.read_text()) for p in paths]


def build_policy(policy: str) -> Path:
    """The policy's directory; a preset missing from the cache is pre-trained first, in this process, as the recipe's
    `--build-policy` does."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.tasks.policy import resolve_policy

    return resolve_policy(policy)


def _summaries(paths: list[Path]) -> list[dict] | None:
    """Every rank's summary, or None if one is missing or not whole JSON."""
    try:
        return [json.loads(p.read_text()) for p in paths]
    except (OSError, ValueError):
        return None


TEARDOWN_GRACE_S = 30.0


def _wait(proc: subprocess.Popen, summaries: list[Path], timeout_s: float, log: Path) -> int:
    """The run's exit code; 0 for a run killed in teardown after every summary was written (run_trl's doc)."""
    deadline, written_at = time.monotonic() + timeout_s, None
    while (rc := proc.poll()) is None:
        now = time.monotonic()
        if written_at is None and all(p.exists() for p in summaries):
            written_at = now
        if written_at is not None and now - written_at > TEARDOWN_GRACE_S:
            _kill_run(proc)
            print(f"warning: every rank wrote its summary but the run had not exited {TEARDOWN_GRACE_S:.0f} s later "
                  f"(teardown hang); killed. Log: {log}", file=sys.stderr)
            return 0
        if now > deadline:
            _kill_run(proc)
            raise RuntimeError(f"TRL run still going after {timeout_s:.0f} s, killed; last lines of {log}:\n"
                               f"{_tail(log, 80)}")
        time.sleep(0.2)
    return rc


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group and every process descended from it, each with its own group:
    torchrun starts every rank in a new session (so that it can kill a rank's group), so killing the
    launcher's group alone left a rank hung in teardown running after the test suite ended."""
    pids = descendants(proc.pid)  # before the launcher dies and its ranks are re-parented
    for pid in [proc.pid, *pids]:
        for kill in (os.killpg, os.kill):  # the group where the process leads one, the process itself
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()


def _tail(path: Path, n: int) -> str:
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(summary: dict) -> list[float]:
    return [h["loss"] for h in summary["log_history"] if "loss" in h]


def step_seconds(summary: dict) -> float:
    """Mean wall time of an optimizer step (TRL's train_runtime / steps: generation, scoring, update, callbacks)."""
    end = [h for h in summary["log_history"] if "train_runtime" in h][-1]
    return end["train_runtime"] / max(1, len(losses(summary)))


def _p99(xs: list[float]) -> float:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import numpy as np

    return float(np.percentile(xs, 99)) if xs else 0.0


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import redis

    from tailspec.redis_server import start_redis
    from tailspec.tasks.policy import cached_policy

    out = sys.stderr if args.json else sys.stdout
    server = None if args.redis else start_redis()
    url = args.redis or server.url
    work = Path(tempfile.mkdtemp(prefix="tailspec-bench-attach-"))
    kw = {"ranks": args.ranks, "steps": args.steps, "seed": args.seed, "dataset": args.dataset, "policy": args.policy}
    r = redis.Redis.from_url(url)
    try:
        print(f"bench attach: TRL GRPOTrainer, {args.ranks} ranks, {args.steps} steps, policy {args.policy}, "
              f"dataset {args.dataset}, seed {args.seed}, {args.repeats} repeats", file=out)
        if cached_policy(args.policy) is None:
            # here, with its progress bar, rather than silently inside the first run's ranks (minutes on 2 cores)
            print(f"  the {args.policy} policy is not cached: pre-training it first", file=out)
            build_policy(args.policy)
        redis_pid = server.pid if server is not None else None
        reps = [_repeat(i, r, url, work, args.ranks, kw, out, redis_pid) for i in range(args.repeats)]
        result = {"device": machine(), "ranks": args.ranks, "steps": args.steps, "seed": args.seed,
                  "dataset": args.dataset, "policy": args.policy, "telemetry": "simulated", "repeats": args.repeats,
                  **summarize(reps)}
        print(f"  overhead, median of {args.repeats}: {result['attach_overhead']:+.1%} (runs "
              + " / ".join(f"{x:+.1%}" for x in result["attach_overhead_runs"])
              + f"); lending off {result['attach_overhead_no_lend']:+.1%}; reclaimed {result['reclaimed_share']:.0%} "
              f"of {result['idle_gpu_seconds']:.2f} idle GPU-s, wait_reclaimed p99 "
              f"{result['wait_reclaimed_p99_s']:.3f} s, loss curves equal: {result['loss_curves_equal']}; "
              f"renewals {result['renewal_share_of_session_step']:.2%} of the sessions' step time", file=out)
        parts = result["wait_reclaimed_parts"]
        print(f"  wait_reclaimed with a session to stop ({parts['waits']} waits), median / max s: "
              + ", ".join(f"{k} {parts[k]['median']:.3f} / {parts[k]['max']:.3f}"
                          for k in ("scheduler", "session", "trainer")), file=out)
        for name in ("lend", "no_lend"):
            b = result[f"overhead_breakdown_{name}"]
            print(f"  per step, lending {'on' if name == 'lend' else 'off'}: overhead {b['overhead_s']:+.3f} s; trainer "
                  "threads " + ", ".join(f"{c} {v:.3f}" for c, v in b["trainer_thread_s"].items())
                  + f" (sum {b['trainer_thread_total_s']:.3f}); unlocated {b['unlocated_s']:+.3f} s; host CPU "
                  + ", ".join(f"{c} {v:.3f}" for c, v in b["host_cpu_s"].items()) + " CPU-s", file=out)
        return result
    finally:
        r.close()
        if server is not None:
            server.stop()


def _repeat(i: int, r, url: str, work: Path, ranks: int, kw: dict, out, redis_pid: int | None) -> dict:
    """One repeat: the unattached run, attached with lending on, and attached with lending off, one after another
    (the three are compared within a repeat: the machine's drift between repeats stays out of each ratio), their
    order rotated by the repeat's index, so that over three repeats each runs first, second and third once and a
    drift within a repeat does not favour one of them. The host CPU beside the ranks is read around each attached
    run (benchmarks/attach_costs.py)."""
    got: dict = {}

    def attached(lend: bool) -> None:
        name = "lend" if lend else "nolend"
        cluster = f"attach-{name}-{i}"
        shared = work / cluster
        with local_scheduler(scheduler_config(url, cluster, shared, ranks, lend=lend), shared / "logs"):
            before = host_cpu(redis_pid)
            summ = run_trl(work / f"{cluster}.json", url=url, cluster=cluster, shared=shared, **kw)
            got[f"cpu_{name}"] = host_cpu(redis_pid) - before
        got[name] = summ
        if lend:
            got["counters"] = {k.decode(): float(v) for k, v in r.hgetall(state.key(cluster, "counters")).items()}
            got["reclaim_parts"] = reclaim_parts(r, cluster, summ[0]["tailspec"]["waits"])

    runs = [lambda: got.__setitem__("base", run_trl(work / f"plain-{i}.json", **kw)),
            lambda: attached(True), lambda: attached(False)]
    for k in range(3):
        runs[(i + k) % 3]()
    print(f"  repeat {i + 1}: unattached {step_seconds(got['base'][0]):.3f} s/step, lending on "
          f"{step_seconds(got['lend'][0]):.3f}, off {step_seconds(got['nolend'][0]):.3f}", file=out)
    return got


def summarize(reps: list[dict]) -> dict:
    """Medians over repeats of the step times and of each repeat's own overheads; lending figures summed."""
    base = [step_seconds(x["base"][0]) for x in reps]
    att = [step_seconds(x["lend"][0]) for x in reps]
    nolend = [step_seconds(x["nolend"][0]) for x in reps]
    idle = sum(x["counters"].get("idle_gpu_seconds", 0.0) for x in reps)
    lent = sum(x["counters"].get("lent_gpu_seconds", 0.0) for x in reps)
    waits = [w["waited_s"] for x in reps for s in x["lend"] for w in s["tailspec"]["waits"]]
    over = [a / b - 1 for a, b in zip(att, base)]
    over_off = [a / b - 1 for a, b in zip(nolend, base)]
    renew = sum(x["counters"].get("session_renew_seconds", 0.0) for x in reps)
    trained = sum(x["counters"].get("session_train_seconds", 0.0) for x in reps)
    steps = max(1, len(losses(reps[0]["base"][0]))) if reps else 1
    return {
        "step_s_unattached": statistics.median(base), "step_s_attached": statistics.median(att),
        "step_s_attached_no_lend": statistics.median(nolend),
        "attach_overhead": statistics.median(over), "attach_overhead_runs": over,
        "attach_overhead_no_lend": statistics.median(over_off), "attach_overhead_no_lend_runs": over_off,
        "idle_gpu_seconds": idle, "lent_gpu_seconds": lent, "reclaimed_share": lent / idle if idle else 0.0,
        "wait_reclaimed_p99_s": _p99(waits), "wait_reclaimed_max_s": max(waits, default=0.0),
        "sessions": int(sum(x["counters"].get("sessions_started", 0) for x in reps)),
        "samples": sum(s["tailspec"]["samples"] for x in reps for s in x["lend"]),
        "loss_curves_equal": all(losses(x["base"][0]) == losses(x["lend"][0]) == losses(x["nolend"][0]) for x in reps),
        # the sessions' lease renewal threads' CPU time / their training steps' time
        "renewal_share_of_session_step": renew / trained if trained else 0.0,
        "session_renew_seconds": renew, "session_train_seconds": trained,
        "wait_reclaimed_parts": parts_summary([p for x in reps for p in x["reclaim_parts"]]),
        "overhead_breakdown_lend": breakdown([a - b for a, b in zip(att, base)],
                                             [trainer_seconds(x["lend"]) for x in reps],
                                             [x["cpu_lend"] for x in reps], steps),
        "overhead_breakdown_no_lend": breakdown([a - b for a, b in zip(nolend, base)],
                                                [trainer_seconds(x["nolend"]) for x in reps],
                                                [x["cpu_nolend"] for x in reps], steps),
    }
