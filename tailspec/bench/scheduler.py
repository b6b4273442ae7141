"""Scheduler: a simulated long-tail rollout lending drained GPUs to sessions (real Redis, real processes).

N simulated workers (each a replica over `--gpus`/N GPUs, SIMULATED telemetry) decode requests whose lengths
are drawn from the built-in task's heavy-tailed length distribution; the real scheduler runs as its own
process, detects drained GPUs, leases them to session processes and revokes them when the phase ends.

Sessions (`--session`):
- `real` (default up to 16 GPUs): the drafter-training session the scheduler starts by default
  (`tailspec.sessions:run_session`: teacher loaded from the policy the phase names, samples read from the
  sample stream, lineage merges), on the cached `micro` policy (`--policy`) and 160 of its cached task
  samples submitted to the stream before the first step; warm session processes (imports done), as the demo;
- `busy`: `tailspec.scheduler.demo_session:busy_session`, which trains nothing (the scheduler's own overhead);
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
Targets: detect p99 ≤ 0.5 s, release-to-free p99 ≤ 1 s, reclaimed ≥ 0.9, CPU ≤ 5%, tick p99 ≤ 100 ms.

Also a module run in the bench's own processes (`python -m tailspec.bench.scheduler serve|monitor`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tailspec.core import state
from tailspec.core.config import TailspecConfig, TaskConfig
from tailspec.core.state import Event, SessionInfo

TARGETS = {
    "detect_latency_p99_s": ("<=", 0.5),
    "release_to_free_p99_s": ("<=", 1.0),
    "reclaimed_share": (">=", 0.9),
    "scheduler_cpu_share": ("<=", 0.05),
    "tick_p99_s": ("<=", 0.1),
}
REAL_ENTRY = "tailspec.sessions:run_session"
BUSY_ENTRY = "tailspec.scheduler.demo_session:busy_session"
PROFILE_ENV = "TAILSPEC_BENCH_PROFILE"  # set: the scheduler process is profiled (cProfile) into this file
SCALE_GPUS = 16  # above this, sessions default to `none`


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=None,
                   help="simulated rollout workers (default 4 with real sessions, 8 otherwise)")
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


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads, not its children) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def _should_continue_cost(r, url: str, cluster: str) -> tuple[float, float]:
    """What a session pays per training step: p50 of a real lease renewal round trip (ms), and p50 of
    should_continue() as called every step with the default renewal spacing (µs)."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    from tailspec.scheduler.leases import Leases
    from tailspec.scheduler.session import SessionContext

    c = f"{cluster}-cost"
    r.set(state.key(c, "scheduler_heartbeat"), "1", px=60_000)
    lease = Leases(r, c).acquire("n", 0, "bench", ttl_s=30)
    ctx = SessionContext(session_id="cost", node="n", gpu=0, lease_token=lease.token, redis_url=url, cluster=c,
                         lease_ttl_s=30, min_renew_interval_s=0)
    rt = []
    for _ in range(300):
        t0 = time.perf_counter()
        assert ctx.should_continue()
        rt.append(time.perf_counter() - t0)
    ctx.min_renew_interval_s = SessionContext.min_renew_interval_s
    per_step = []
    for _ in range(2000):
        t0 = time.perf_counter()
        ctx.should_continue()
        per_step.append(time.perf_counter() - t0)
        time.sleep(0.0005)  # a (very short) training step
    return round(float(np.median(rt)) * 1e3, 3), round(float(np.median(per_step)) * 1e6, 2)


# -- the bench's own processes ---------------------------------------------------------------------------------


class RoundTrips:
    """Counts what a redis-py client sends: round trips (a direct command, or one pipeline execute) and commands.
    Installed on the instance (execute_command and pipeline), so scripts, scans and pipelines are all counted."""

    def __init__(self, r) -> None:
        self.trips = self.commands = 0
        self.by_name: collections.Counter[str] = collections.Counter()
        direct, make_pipe = r.execute_command, r.pipeline

        def execute_command(*a, **kw):
            self.trips += 1
            self.commands += 1
            self.by_name[str(a[0])] += 1
            return direct(*a, **kw)

        def pipeline(*a, **kw):
            p = make_pipe(*a, **kw)
            run = p.execute

            def execute(*ea, **ekw):
                n = len(p.command_stack)
                if n:
                    self.trips += 1
                    self.commands += n
                    self.by_name.update(str(c[0][0]) for c in p.command_stack)
                return run(*ea, **ekw)

            p.execute = execute
            return p

        r.execute_command, r.pipeline = execute_command, pipeline


class NullDispatcher:
    """Starts no process: a lent GPU's session exists only in the scheduler's records and ends when it is revoked
    (the scheduler cancels a session that never reported running). For the scale bench."""

    def __init__(self) -> None:
        self.ended: dict[str, int] = {}
        self.live: set[str] = set()

    def start(self, ctx) -> None:
        self.live.add(ctx.session_id)

    def cancel(self, session_id: str) -> None:
        self.stop(session_id)

    def stop(self, session_id: str) -> None:
        if session_id in self.live:
            self.live.discard(session_id)
            self.ended[session_id] = 0

    def poll(self) -> set[str]:
        return set(self.ended)

    def forget(self, session_id: str) -> None:
        self.ended.pop(session_id, None)

    def pid(self, session_id: str) -> int | None:
        return None

    def shutdown(self) -> None:
        for sid in list(self.live):
            self.stop(sid)


def _load_cfg(path: str):
    return TailspecConfig.model_validate(json.loads(Path(path).read_text()))


def serve(args: argparse.Namespace) -> int:
    """The scheduler process: the service's Scheduler with its tick timed and its Redis traffic counted
    (RoundTrips); with --monitor, the node's simulated telemetry monitor as a thread (as `tailspec scheduler run`),
    on its own connection. Writes every tick (start time, seconds, thread CPU seconds, round trips, commands) to
    --stats at exit (SIGTERM)."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import redis

    from tailspec.scheduler.dispatch import LocalDispatcher
    from tailspec.scheduler.monitor import TelemetryMonitor
    from tailspec.scheduler.service import Scheduler, simulated_gpu_cpus
    from tailspec.scheduler.telemetry import SimulatedTelemetry

    cfg = _load_cfg(args.config)
    sc, url = cfg.scheduler, cfg.cluster.redis_url
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    monitor = None
    if args.monitor:
        rm = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        tel = SimulatedTelemetry(cfg.cluster.node, rm, cfg.cluster.name, sc.simulated_gpus,
                                 mem_total=int(sc.simulated_gpu_mem_gib * (1 << 30)))
        monitor = TelemetryMonitor(tel, rm, cfg.cluster.name, sc.sample_period_s, sc.history_maxlen).start()
    r = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    rt = RoundTrips(r)
    if args.session == "none":
        dispatcher = NullDispatcher()
    else:
        dispatcher = LocalDispatcher(sc.session_entry, log_dir=args.log_dir, warm=sc.warm_sessions,
                                     nice=sc.session_nice, gpu_cpus=simulated_gpu_cpus(cfg))
    sched = Scheduler(cfg, r, dispatcher, redis_url=url)
    ticks: list[tuple[float, float, float, int, int]] = []
    tick = sched.tick

    def timed_tick(now: float | None = None):
        t_wall, t0, c0 = time.time(), time.perf_counter(), time.thread_time()
        trips, cmds = rt.trips, rt.commands
        try:
            return tick(now)
        finally:
            ticks.append((t_wall, time.perf_counter() - t0, time.thread_time() - c0, rt.trips - trips,
                          rt.commands - cmds))

    sched.tick = timed_tick
    prof = None
    if args.profile:
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        sched.serve(stop)
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.profile)
        if monitor is not None:
            monitor.stop()
        sched.shutdown()
        tmp = args.stats + ".tmp"
        Path(tmp).write_text(json.dumps({"ticks": ticks, "errors": sched.errors, "commands": dict(rt.by_name)}))
        os.replace(tmp, args.stats)
    return 0


def monitor_main(args: argparse.Namespace) -> int:
    """The nodes' telemetry monitors of a many-node simulated cluster, in one process (SimulatedNodes)."""
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import redis

    from tailspec.scheduler.monitor import TelemetryMonitor
    from tailspec.scheduler.telemetry import SimulatedNodes

    cfg = _load_cfg(args.config)
    sc = cfg.scheduler
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    r = redis.Redis.from_url(cfg.cluster.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    nodes = {str(k): int(v) for k, v in json.loads(args.nodes).items()}
    tel = SimulatedNodes(r, cfg.cluster.name, nodes, mem_total=int(sc.simulated_gpu_mem_gib * (1 << 30)))
    TelemetryMonitor(tel, r, cfg.cluster.name, sc.sample_period_s, sc.history_maxlen).run(stop)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tailspec.bench.scheduler")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--config", required=True)
    s.add_argument("--stats", required=True)
    s.add_argument("--log-dir", required=True)
    s.add_argument("--session", choices=["real", "busy", "none"], required=True)
    s.add_argument("--monitor", action="store_true")
    s.add_argument("--profile", metavar="PATH", help="cProfile the scheduler loop into PATH")
    m = sub.add_parser("monitor")
    m.add_argument("--config", required=True)
    m.add_argument("--nodes", required=True, help="JSON: node name -> GPU count")
    args = p.parse_args(argv)
    return serve(args) if args.cmd == "serve" else monitor_main(args)


# -- the bench -------------------------------------------------------------------------------------------------


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


def _tick_figures(ticks: list, t0: float, t1: float, wall: float) -> dict:
    window = [t for t in ticks if t0 <= t[0] <= t1] or ticks
    secs = [t[1] for t in window]
    trips = [t[3] for t in window]
    cmds = [t[4] for t in window]
    return {
        "ticks": len(window),
        "tick_p50_s": _pct(secs, 50),
        "tick_p99_s": _pct(secs, 99),
        "tick_max_s": round(max(secs), 4) if secs else None,
        # the scheduler thread's own CPU time per tick: the tick without the waits for a core on a shared machine
        "tick_cpu_p50_s": _pct([t[2] for t in window], 50),
        "tick_cpu_p99_s": _pct([t[2] for t in window], 99),
        "tick_cpu_share": round(sum(t[2] for t in window) / max(1e-9, wall), 4),
        "round_trips_per_tick_mean": round(float(np.mean(trips)), 2) if trips else None,
        "round_trips_per_tick_max": max(trips) if trips else None,
        "commands_per_tick_mean": round(float(np.mean(cmds)), 1) if cmds else None,
    }


def _release_figures(r, cluster: str, events: list) -> dict:
    """Revocation → GPU free, per revoked session: its own final record's stop time (written after the entry
    returned and dropped its teacher, drafter and optimizer, or on SIGTERM) minus the revocation event's time."""

    free, not_ended, terminated = [], 0, 0
    for _, e in events:
        sid = e.detail.get("session_id") if e.kind == "lease_revoked" else None
        if sid is None:
            continue
        info = state.get(r, state.key(cluster, "session", session_id=sid), SessionInfo)
        if info is None or info.stopped_at is None or (info.stop_reason or "").startswith("scheduler:"):
            not_ended += 1  # no record of its own: killed, or (none) never ran
            continue
        terminated += (info.stop_reason == "terminated")
        free.append(max(0.0, info.stopped_at - e.ts))
    return {"release_to_free_p50_s": _pct(free, 50), "release_to_free_p99_s": _pct(free, 99),
            "release_to_free_max_s": round(max(free), 4) if free else None, "revoked_sessions_ended": len(free),
            "revoked_sessions_terminated": terminated, "revoked_sessions_without_own_record": not_ended}


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


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import redis

    from tailspec.redis_server import start_redis
    from tailspec.scheduler.client import TailspecClient
    from tailspec.scheduler.dispatch import warm_ready
    from tailspec.scheduler.simulate import node_gpus, run_simulated_rollout
    from tailspec.tasks.runsum import sample_problems

    workers = args.workers or (4 if args.session in (None, "real") and (args.gpus or 0) <= SCALE_GPUS else 8)
    gpus = args.gpus or workers
    if gpus % workers:
        raise SystemExit(f"--gpus ({gpus}) must be a multiple of --workers ({workers})")
    per_worker = gpus // workers
    per_node = args.gpus_per_node or (8 if gpus > SCALE_GPUS else None)
    session = args.session or ("real" if gpus <= SCALE_GPUS else "none")
    hours = args.sample_hours if args.sample_hours is not None else (1.0 if gpus > SCALE_GPUS else 0.0)
    nodes = node_gpus("node0", gpus, per_node)
    if session != "none" and gpus > 64:
        raise SystemExit(f"--session {session} starts a process per lent GPU: at most 64 GPUs (use --session none)")
    out = sys.stderr

    server = None
    url = args.redis
    if url is None:
        server = start_redis()
        url = server.url
    cluster = f"bench{os.getpid()}"
    r = redis.Redis.from_url(url)
    # Response lengths in tokens of the task's gold answers (+1 for EOS): the task's heavy tail.
    n = workers * args.requests_per_worker * args.steps
    lengths = [len(p.gold) + 1 for p in sample_problems(n, TaskConfig(), seed=args.seed)]
    tmp = Path(tempfile.mkdtemp(prefix="tailspec-bench-scheduler-"))
    logs = tmp / "sessions"
    logs.mkdir()
    policy_dir, samples = None, []
    if session == "real":
        # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
        from tailspec.bench.trainer import policy_samples

        policy_dir, samples = policy_samples(args.policy, 160, seed=1, max_new_tokens=128)
    warm = 0 if session == "none" else min(64, gpus)
    one_node = len(nodes) == 1
    cfg = TailspecConfig.model_validate({
        "cluster": {"name": cluster, "redis_url": url, "node": "node0"},
        "scheduler": {"telemetry": "simulated", "simulated_gpus": min(64, gpus), "warm_sessions": warm,
                      "session_entry": REAL_ENTRY if session == "real" else BUSY_ENTRY},
        "trainer": {"checkpoint_dir": str(tmp / "drafter"), "batch_size": 4, "merge_every_steps": 2},
    })
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
    stats_path = tmp / "ticks.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    me = [sys.executable, "-m", "tailspec.bench.scheduler"]
    sched = mon = None
    client = None
    try:
        sched = subprocess.Popen([*me, "serve", "--config", str(cfg_path), "--stats", str(stats_path),
                                  "--log-dir", str(logs), "--session", session, *(["--monitor"] if one_node else []),
                                  *(["--profile", os.environ[PROFILE_ENV]] if os.environ.get(PROFILE_ENV) else [])],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not one_node:  # the nodes' monitors: another process, as on a cluster (their CPU is not the scheduler's)
            mon = subprocess.Popen([*me, "monitor", "--config", str(cfg_path), "--nodes", json.dumps(nodes)],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs = [p for p in (sched, mon) if p is not None]
        _wait("scheduler start", lambda: r.get(state.key(cluster, "scheduler_heartbeat")) is not None, 60, procs)
        if warm:
            t_w = time.time()
            _wait("warm session processes", lambda: warm_ready(logs) >= warm, 600, procs)
            print(f"scheduler bench: {warm} warm session processes ready in {time.time() - t_w:.1f} s", file=out)
        if not one_node:
            _wait("telemetry of every GPU", lambda: r.scard(state.key(cluster, "gpus")) >= gpus, 60, procs)
        client = TailspecClient(url, cluster=cluster, node="node0")
        if samples:
            client.submit_samples(samples)
            client.flush(30.0)
        print(
            f"scheduler bench: {workers} workers x {per_worker} GPU(s) = {gpus} GPUs on {len(nodes)} node(s), "
            f"{args.steps} steps, {args.requests_per_worker} requests each, {args.token_time * 1000:.0f} ms/token, "
            f"lengths from the runsum task (p50 {np.median(lengths):.0f}, max {max(lengths)} tokens); sessions: "
            f"{session}" + (f" ({policy_dir.name}, {len(samples)} samples in the stream)" if policy_dir else "")
            + "; SIMULATED GPU telemetry", file=out)
        cpu0, wall0, t_start = _proc_cpu_s(sched.pid), time.monotonic(), time.time()
        sent0 = client.sent["progress"]
        sim = run_simulated_rollout(
            url, workers=workers, steps=args.steps, gpus_per_worker=per_worker, gpus_per_node=per_node,
            policy_path=str(policy_dir) if policy_dir else None, requests_per_worker=args.requests_per_worker,
            lengths=lengths, token_time_s=args.token_time, train_s=args.train_s, cluster=cluster, node="node0",
            seed=args.seed, client=client)
        cpu1, wall1, t_end = _proc_cpu_s(sched.pid), time.monotonic(), time.time()
        written = client.sent["progress"] - sent0
        time.sleep(args.train_s + 2.0)  # let the last revocations finish
        mon_cpu = _proc_cpu_s(mon.pid) if mon is not None else None
    finally:
        if client is not None:
            client.close()
        _stop(mon)
        _stop(sched)
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    ticks = stats.get("ticks", [])
    wall = wall1 - wall0
    renew_ms, check_us = _should_continue_cost(r, url, cluster)
    counters = {k.decode(): float(v) for k, v in r.hgetall(state.key(cluster, "counters")).items()}
    events, _ = state.read_stream(r, state.key(cluster, "events"), Event)
    detect = [e.detail["detect_latency_s"] for _, e in events if e.kind == "gpu_idle"]
    reclaim = [e.detail["release_latency_s"] for _, e in events
               if e.kind == "session_stopped" and e.detail.get("release_latency_s") is not None]
    sessions = []
    for sid in r.smembers(state.key(cluster, "sessions")):
        info = state.get(r, state.key(cluster, "session", session_id=sid.decode()), SessionInfo)
        if info is not None:
            sessions.append(info)
    head = r.get(state.key(cluster, "lineage_head")) if session == "real" else None
    idle = sim.idle_gpu_seconds
    lent = counters.get("lent_gpu_seconds", 0.0)
    result = {
        "workers": workers,
        "gpus": gpus,
        "gpus_per_worker": per_worker,
        "nodes": len(nodes),
        "session": session,
        "policy": policy_dir.name if policy_dir else None,
        "steps": args.steps,
        "rollout_seconds": round(sim.rollout_seconds, 3),
        "idle_gpu_seconds": round(idle, 3),
        "scheduler_idle_gpu_seconds": round(counters.get("idle_gpu_seconds", 0.0), 3),
        "lent_gpu_seconds": round(lent, 3),
        "reclaimed_share": round(lent / idle, 4) if idle > 0 else None,
        "detect_latency_p50_s": _pct(detect, 50),
        "detect_latency_p99_s": _pct(detect, 99),
        **_release_figures(r, cluster, events),
        "reclaim_counted_p50_s": _pct(reclaim, 50),
        "reclaim_counted_p99_s": _pct(reclaim, 99),
        "detections": len(detect),
        "revocations": len(reclaim),
        "sessions_started": int(counters.get("sessions_started", 0)),
        "sessions_failed": sum(1 for s in sessions if s.status == "failed"),
        "sessions_declined": sum(1 for s in sessions if s.declined),
        "session_steps": sum(s.step for s in sessions),
        "lineage_head": json.loads(head) if head else None,
        "scheduler_cpu_share": round((cpu1 - cpu0) / max(1e-9, wall), 4),
        "monitor_cpu_share": round(mon_cpu / max(1e-9, wall), 4) if mon_cpu is not None else None,
        **_tick_figures(ticks, t_start, t_end, wall),
        "scheduler_commands": stats.get("commands"),  # every command of the scheduler's run, by name
        "client_reports": sim.progress_reports,
        "client_reports_per_s": round(sim.progress_reports / max(1e-9, sim.report_seconds), 1),
        "client_writes_per_s": round(written / max(1e-9, sim.report_seconds), 1),
        "renew_roundtrip_p50_ms": renew_ms,
        "should_continue_p50_us": check_us,
        "telemetry": "simulated",
        "session_logs": str(logs),
    }
    result.update(_client_capacity(url, cluster, workers))
    if hours > 0:
        steps = max(1, round(hours * 3600 / args.rl_step_s))
        per_step = workers * args.requests_per_worker
        print(f"scheduler bench: {hours:g} h of samples at one RL step per {args.rl_step_s:g} s: {steps} steps x "
              f"{per_step} samples", file=out)
        result["sample_hours"] = hours
        result.update(_sample_memory(r, url, cluster, steps, per_step, lengths, args.seed, out))
    r.close()
    if server is not None:
        server.stop()
    _print(result, out)
    return result


def _print(res: dict, out) -> None:
    print(f"\nscheduler bench: {res['gpus']} GPUs, sessions {res['session']} (SIMULATED GPU telemetry; real Redis, "
          "scheduler and session processes)", file=out)
    for k, (op, target) in TARGETS.items():
        v = res.get(k)
        ok = v is not None and (v >= target if op == ">=" else v <= target)
        print(f"  {k:24s} {v if v is not None else '-':>10}  target {op} {target}  {'ok' if ok else 'MISSED'}",
              file=out)
    print(f"  idle {res['idle_gpu_seconds']:.1f} GPU-s (truth), lent {res['lent_gpu_seconds']:.1f} GPU-s, "
          f"{res['sessions_started']} sessions, {res['session_steps']} session steps, {res['sessions_failed']} "
          f"failed, {res['sessions_declined']} declined", file=out)
    print(f"  tick p50 {res['tick_p50_s']} s, max {res['tick_max_s']} s over {res['ticks']} ticks; Redis round "
          f"trips per tick {res['round_trips_per_tick_mean']} (max {res['round_trips_per_tick_max']}), "
          f"{res['commands_per_tick_mean']} commands", file=out)
    print(f"  client: {res['client_reports_per_s']} reports/s in the rollout; capacity "
          f"{res['client_report_calls_per_s']} calls/s, {res['client_report_writes_per_s']} writes/s", file=out)
    if "redis_used_memory_bytes" in res:
        print(f"  Redis used_memory {res['redis_used_memory_bytes'] / 2**20:.1f} MiB after {res['samples_written']}"
              f" samples (stream {res['sample_stream_len']}); flat: {res['redis_memory_flat']}", file=out)


if __name__ == "__main__":
    sys.exit(main())
