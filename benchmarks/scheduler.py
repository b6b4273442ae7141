"""Scheduler: a scripted long-tail rollout lending drained GPUs to sessions (real Redis, real processes).

N simulated workers (each a replica over `--gpus`/N GPUs, SIMULATED telemetry) decode requests whose lengths
are drawn from the built-in task's heavy-tailed length distribution; the real scheduler runs as its own
process, detects drained GPUs, leases them to session processes and revokes them when the phase ends.

Sessions (`--session`):
- `real` (default up to 16 GPUs): the drafter-training session the scheduler starts by default
  (`tailspec.session_entry:ENTRY`: teacher loaded from the policy the phase names, samples read from the
  sample stream, lineage merges), on the cached `micro` policy (`--policy`) and 160 of its cached task
  samples submitted to the stream before the first step; warm session processes (imports done), as the demo;
- `busy`: `tailspec.scheduler.busy_sessions:busy_session`, which trains nothing (the scheduler's own overhead);
- `none` (default above 16 GPUs): no process at all; the scheduler does all its own work (leases, records,
  renewals, revokes, events) and a session counts as ended when it is revoked. On this machine a thousand
  GPUs' sessions cannot run; on a cluster they run on their own nodes and cost the scheduler the same.

Figures: idle GPU-seconds (ground truth from the simulation: Σ phase end − drain), lent GPU-seconds
(scheduler's counter: time GPUs spent LENT), reclaimed share = lent ÷ idle, detect latency (drain → idle
confirmed), release-to-free latency (revoke → the session has ended: its entry returned with its teacher,
drafter and optimizer freed, or its process terminated, as its own final record dates it), reclaim-counted
latency (revoke → the scheduler counts the GPU reclaimed: session end seen, or the stop deadline), the
scheduler's tick time and Redis round trips per tick (measured inside the scheduler process), its CPU time ÷
wall time, the client's sustained progress-report rate and, with `--sample-hours`, Redis memory while an
hour-equivalent of samples goes into the (trimmed) sample stream.
The JSON's `release_latency_p50_s` / `release_latency_p99_s` are aliases of `reclaim_counted_p50_s` /
`reclaim_counted_p99_s` (the same values: revoke → reclaim counted, not release-to-free), for readers of results
that use those names.
Targets: detect p99 ≤ 0.5 s, release-to-free p99 ≤ 1 s, reclaimed ≥ 0.9, CPU ≤ 5%, tick p99 ≤ 100 ms.

The bench's own processes are in scheduler_procs.py, its figures and report in scheduler_report.py, the records of
a run both read in scheduler_run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tailspec.benchmarks.scheduler_report import print_report, result
from tailspec.benchmarks.scheduler_run import Rollout, Run, Shape
from tailspec.core import state
from tailspec.core.config import TailspecConfig, TaskConfig

from tailspec.tasks.runsum import sample_problems

REAL_ENTRY = "tailspec.session_entry:ENTRY"
BUSY_ENTRY = "tailspec.scheduler.busy_sessions:busy_session"
PROFILE_ENV = "TAILSPEC_BENCH_PROFILE"  # set: the scheduler process is profiled (cProfile) into this file
SCALE_GPUS = 16  # above this, sessions default to `none`
PROCS = [sys.executable, "-m", "tailspec.benchmarks.scheduler_procs"]  # the bench's scheduler and monitor processes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=None,
                   help="scripted rollout workers (default 4 with real sessions, 8 otherwise)")
    p.add_argument("--gpus", type=int, default=None,
                   help="simulated GPUs (default one per worker); a multiple of --workers: each worker is a "
                        "tensor-parallel replica over gpus/workers GPUs")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help=f"GPUs per simulated node (default 8 above {SCALE_GPUS} GPUs, else one node)")
    p.add_argument("--session", choices=["real", "busy", "none"], default=None,
                   help=f"what a lent GPU runs (default real up to {SCALE_GPUS} GPUs, none above)")
    p.add_argument("--policy", default="micro", help="policy preset real sessions distil (default micro, cached)")
    p.add_argument("--steps", type=int, default=3, help="RL steps (rollout + train phases) (default 3)")
    p.add_argument("--requests-per-worker", type=int, default=8)
    p.add_argument("--token-time", type=float, default=0.03, help="seconds per decoded token (default 0.03)")
    p.add_argument("--train-s", type=float, default=1.0, help="train phase length between rollouts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-hours", type=float, default=None,
                   help="after the rollout, write this many hours' worth of samples to the sample stream and "
                        f"follow Redis memory (default 1 above {SCALE_GPUS} GPUs, else 0)")
    p.add_argument("--rl-step-s", type=float, default=60.0,
                   help="RL step length the hour-equivalent assumes: one new policy version and "
                        "workers x requests-per-worker samples per step (default 60)")
    p.add_argument("--redis", metavar="URL", help="use this Redis instead of a private redis-server")


def shape_of(args: argparse.Namespace) -> Shape:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.scripted_rollout import node_gpus

    workers = args.workers or (4 if args.session in (None, "real") and (args.gpus or 0) <= SCALE_GPUS else 8)
    gpus = args.gpus or workers
    if gpus % workers:
        raise SystemExit(f"--gpus ({gpus}) must be a multiple of --workers ({workers})")
    per_node = args.gpus_per_node or (8 if gpus > SCALE_GPUS else None)
    session = args.session or ("real" if gpus <= SCALE_GPUS else "none")
    hours = args.sample_hours if args.sample_hours is not None else (1.0 if gpus > SCALE_GPUS else 0.0)
    nodes = node_gpus("node0", gpus, per_node)
    if session != "none" and gpus > 64:
        raise SystemExit(f"--session {session} starts a process per lent GPU: at most 64 GPUs (use --session none)")
    return Shape(workers, gpus, gpus // workers, per_node, session, hours, nodes)


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import redis

    from tailspec.redis_server import start_redis

    shape = shape_of(args)
    server = None
    url = args.redis
    if url is None:
        server = start_redis()
        url = server.url
    cluster = f"bench{os.getpid()}"
    r = redis.Redis.from_url(url)
    # Response lengths in tokens of the task's gold answers (+1 for EOS): the task's heavy tail.
    n = shape.workers * args.requests_per_worker * args.steps
    lengths = [len(p.gold) + 1 for p in sample_problems(n, TaskConfig(), seed=args.seed)]
    tmp = Path(tempfile.mkdtemp(prefix="tailspec-bench-scheduler-"))
    (tmp / "sessions").mkdir()
    policy_dir, samples = _policy_samples(args, shape.session)
    b = Run(args, shape, url, cluster, r, lengths, tmp, policy_dir, samples, sys.stderr)
    w = _rollout(b)
    stats = json.loads(b.stats_path.read_text()) if b.stats_path.exists() else {}
    renew_ms, check_us = _should_continue_cost(r, url, cluster)
    res = result(b, w, stats, renew_ms, check_us)
    res.update(_client_capacity(url, cluster, shape.workers))
    if shape.hours > 0:
        res.update(_sample_hours(b))
    r.close()
    if server is not None:
        server.stop()
    print_report(res, b.out)
    return res


def _policy_samples(args: argparse.Namespace, session: str) -> tuple[Path | None, list]:
    """Real sessions' policy and the task samples submitted to the stream before the first step."""
    if session != "real":
        return None, []
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.tasks.samples import policy_samples

    return policy_samples(args.policy, 160, seed=1, max_new_tokens=128)


def _write_config(b: Run) -> Path:
    shape = b.shape
    cfg = TailspecConfig.model_validate({
        "cluster": {"name": b.cluster, "redis_url": b.url, "node": "node0"},
        "scheduler": {"telemetry": "simulated", "simulated_gpus": min(64, shape.gpus), "warm_sessions": shape.warm,
                      "session_entry": REAL_ENTRY if shape.session == "real" else BUSY_ENTRY},
        "trainer": {"checkpoint_dir": str(b.tmp / "drafter"), "batch_size": 4, "merge_every_steps": 2},
    })
    path = b.tmp / "config.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    return path


def _start_scheduler(b: Run, cfg_path: Path, env: dict) -> subprocess.Popen:
    profile = ["--profile", os.environ[PROFILE_ENV]] if os.environ.get(PROFILE_ENV) else []
    return subprocess.Popen(
        [*PROCS, "serve", "--config", str(cfg_path), "--stats", str(b.stats_path), "--log-dir", str(b.logs),
         "--session", b.shape.session, *(["--monitor"] if b.shape.one_node else []), *profile],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _start_monitors(b: Run, cfg_path: Path, env: dict) -> subprocess.Popen:
    """The nodes' monitors: another process, as on a cluster (their CPU is not the scheduler's)."""
    return subprocess.Popen([*PROCS, "monitor", "--config", str(cfg_path), "--nodes", json.dumps(b.shape.nodes)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_ready(b: Run, procs: list[subprocess.Popen]) -> None:
    """The scheduler's heartbeat, the warm session processes, every GPU's telemetry."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.dispatch import warm_ready

    warm = b.shape.warm
    _wait("scheduler start", lambda: b.r.get(state.key(b.cluster, "scheduler_heartbeat")) is not None, 60, procs)
    if warm:
        t_w = time.time()
        _wait("warm session processes", lambda: warm_ready(b.logs) >= warm, 600, procs)
        print(f"scheduler bench: {warm} warm session processes ready in {time.time() - t_w:.1f} s", file=b.out)
    if not b.shape.one_node:
        _wait("telemetry of every GPU", lambda: b.r.scard(state.key(b.cluster, "gpus")) >= b.shape.gpus, 60, procs)


def _print_start(b: Run) -> None:
    shape, args, lengths = b.shape, b.args, b.lengths
    print(
        f"scheduler bench: {shape.workers} workers x {shape.per_worker} GPU(s) = {shape.gpus} GPUs on "
        f"{len(shape.nodes)} node(s), {args.steps} steps, {args.requests_per_worker} requests each, "
        f"{args.token_time * 1000:.0f} ms/token, lengths from the runsum task (p50 {np.median(lengths):.0f}, max "
        f"{max(lengths)} tokens); sessions: {shape.session}"
        + (f" ({b.policy_dir.name}, {len(b.samples)} samples in the stream)" if b.policy_dir else "")
        + "; SIMULATED GPU telemetry", file=b.out)


def _rollout(b: Run) -> Rollout:
    """The scheduler (and, on many nodes, the monitors) as processes, the scripted rollout against them, and the
    scheduler's CPU time over the rollout's wall time."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.client import TailspecClient
    from tailspec.scheduler.scripted_rollout import run_scripted_rollout

    args, shape = b.args, b.shape
    cfg_path = _write_config(b)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sched = mon = None
    client = None
    try:
        sched = _start_scheduler(b, cfg_path, env)
        if not shape.one_node:
            mon = _start_monitors(b, cfg_path, env)
        _wait_ready(b, [p for p in (sched, mon) if p is not None])
        client = TailspecClient(b.url, cluster=b.cluster, node="node0")
        if b.samples:
            client.submit_samples(b.samples)
            client.flush(30.0)
        _print_start(b)
        cpu0, wall0, t_start = _proc_cpu_s(sched.pid), time.monotonic(), time.time()
        sent0 = client.sent["progress"]
        sim = run_scripted_rollout(
            b.url, workers=shape.workers, steps=args.steps, gpus_per_worker=shape.per_worker,
            gpus_per_node=shape.per_node, policy_path=str(b.policy_dir) if b.policy_dir else None,
            requests_per_worker=args.requests_per_worker, lengths=b.lengths, token_time_s=args.token_time,
            train_s=args.train_s, cluster=b.cluster, node="node0", seed=args.seed, client=client)
        cpu1, wall1, t_end = _proc_cpu_s(sched.pid), time.monotonic(), time.time()
        written = client.sent["progress"] - sent0
        time.sleep(args.train_s + 2.0)  # let the last revocations finish
        mon_cpu = _proc_cpu_s(mon.pid) if mon is not None else None
    finally:
        if client is not None:
            client.close()
        _stop(mon)
        _stop(sched)
    return Rollout(sim, cpu1 - cpu0, wall1 - wall0, t_start, t_end, written, mon_cpu)


def _sample_hours(b: Run) -> dict:
    args, hours = b.args, b.shape.hours
    steps = max(1, round(hours * 3600 / args.rl_step_s))
    per_step = b.shape.workers * args.requests_per_worker
    print(f"scheduler bench: {hours:g} h of samples at one RL step per {args.rl_step_s:g} s: {steps} steps x "
          f"{per_step} samples", file=b.out)
    return {"sample_hours": hours,
            **_sample_memory(b.r, b.url, b.cluster, steps, per_step, b.lengths, args.seed, b.out)}


# -- what the bench measures besides the rollout -----------------------------------------------------------------


def _should_continue_cost(r, url: str, cluster: str) -> tuple[float, float]:
    """What a session pays for its lease: p50 of a real lease renewal round trip (ms; on the session's renewal
    thread), and p50 of should_continue() as a step calls it (µs; a local read)."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.leases import Leases
    from tailspec.scheduler.session_process import SessionContext

    c = f"{cluster}-cost"
    r.set(state.key(c, "scheduler_heartbeat"), "1", px=60_000)
    lease = Leases(r, c).acquire("n", 0, "bench", ttl_s=30)
    ctx = SessionContext(session_id="cost", node="n", gpu=0, lease_token=lease.token, redis_url=url, cluster=c,
                         lease_ttl_s=30)
    rt = []
    for _ in range(300):
        t0 = time.perf_counter()
        assert ctx.keeper.renew() == 1
        rt.append(time.perf_counter() - t0)
    per_step = []
    for _ in range(2000):
        t0 = time.perf_counter()
        ctx.should_continue()
        per_step.append(time.perf_counter() - t0)
        time.sleep(0.0005)  # a (very short) training step
    ctx.close()
    return round(float(np.median(rt)) * 1e3, 3), round(float(np.median(per_step)) * 1e6, 2)


def _client_capacity(url: str, cluster: str, workers: int, seconds: float = 2.0) -> dict:
    """The client's sustained progress-report rate: one thread reporting for `workers` workers as fast as it can
    for `seconds`, then flushed; calls/s (coalesced per worker: latest wins) and entries written to Redis/s."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.client import TailspecClient

    c = TailspecClient(url, cluster=f"{cluster}-cap", node="cap")
    names = [f"cap-w{i}" for i in range(workers)]
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for i, w in enumerate(names):
            c.report_progress(w, [i], active=calls % 7, finished=1, step=1, node="cap")
            calls += 1
    c.flush(10.0)
    dt = time.perf_counter() - t0
    sent, dropped = c.sent["progress"], sum(c.dropped.values())
    c.close()
    return {"client_report_calls_per_s": round(calls / dt), "client_report_writes_per_s": round(sent / dt),
            "client_reports_dropped": dropped}


def _sample_memory(r, url: str, cluster: str, steps: int, per_step: int, lengths: list[int], seed: int,
                   out) -> dict:
    """An hour-equivalent of samples through the client (policy version = RL step), Redis used_memory followed."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.client import TailspecClient

    rng = random.Random(seed)
    c = TailspecClient(url, cluster=cluster, node="samples")
    mem = [int(r.info("memory")["used_memory"])]
    every = max(1, steps // 12)
    t0 = time.time()
    for step in range(1, steps + 1):
        batch = [{"prompt_ids": [rng.randrange(1000) for _ in range(21)],
                  "response_ids": [rng.randrange(1000) for _ in range(lengths[(step * per_step + i) % len(lengths)])],
                  "reward": rng.random(), "policy_version": step} for i in range(per_step)]
        c.submit_samples(batch)
        c.flush(60.0)
        if step % every == 0 or step == steps:
            mem.append(int(r.info("memory")["used_memory"]))
            print(f"  samples: step {step}/{steps}, stream {r.xlen(state.key(cluster, 'samples'))}, "
                  f"used_memory {mem[-1] / 2**20:.1f} MiB", file=out)
    written, dropped = c.sent["samples"], sum(c.dropped.values())
    c.close()
    half = mem[len(mem) // 2]
    return {"samples_written": written, "samples_dropped": dropped, "samples_write_s": round(time.time() - t0, 1),
            "sample_stream_len": int(r.xlen(state.key(cluster, "samples"))),
            "redis_used_memory_bytes": mem[-1], "redis_used_memory_series": mem,
            "redis_memory_flat": max(mem[len(mem) // 2:]) <= 1.05 * half}


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads, not its children) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(what: str, ok, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.time() + timeout_s
    while not ok():
        for pr in procs:
            if pr.poll() is not None:
                err = pr.stderr.read().decode(errors="replace")[-2000:] if pr.stderr else ""
                raise RuntimeError(f"{what}: a bench process exited ({pr.returncode}): {err}")
        if time.time() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
