"""The processes of `tailspec bench scheduler` (`python -m tailspec.benchmarks.scheduler_procs serve|monitor`): the
scheduler with its ticks timed and its Redis traffic counted, and the telemetry monitors of a many-node cluster.
The bench itself (benchmarks/scheduler.py) starts them and reads what `serve` leaves in --stats."""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import redis
from tailspec.core.config import TailspecConfig
from tailspec.scheduler import cpu_quota
from tailspec.scheduler.dispatch import LocalDispatcher
from tailspec.scheduler.monitor import TelemetryMonitor
from tailspec.scheduler.placement import simulated_gpu_placement
from tailspec.scheduler.service import Scheduler
from tailspec.scheduler.telemetry import SimulatedNodes, SimulatedTelemetry


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
    cfg = _load_cfg(args.config)
    sc, url = cfg.scheduler, cfg.cluster.redis_url
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    monitor = _node_monitor(cfg) if args.monitor else None
    r = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    rt = RoundTrips(r)
    if args.session == "none":
        dispatcher = NullDispatcher()
    else:
        gpu_cpus, gpu_cgroups = simulated_gpu_placement(cfg)
        dispatcher = LocalDispatcher(sc.session_entry, log_dir=args.log_dir, warm=sc.warm_sessions,
                                     nice=sc.session_nice, gpu_cpus=gpu_cpus, gpu_cgroups=gpu_cgroups)
    sched = Scheduler(cfg, r, dispatcher, redis_url=url)
    ticks = _time_ticks(sched, rt)
    prof = None
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
    try:
        sched.serve(stop)
    finally:
        for cg in (getattr(dispatcher, "gpu_cgroups", None) or {}).values():
            cpu_quota.remove(cg)
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


def _node_monitor(cfg: TailspecConfig) -> TelemetryMonitor:
    """The node's simulated telemetry monitor, started as a thread on its own connection."""
    sc = cfg.scheduler
    rm = redis.Redis.from_url(cfg.cluster.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    tel = SimulatedTelemetry(cfg.cluster.node, rm, cfg.cluster.name, sc.simulated_gpus,
                             mem_total=int(sc.simulated_gpu_mem_gib * (1 << 30)))
    return TelemetryMonitor(tel, rm, cfg.cluster.name, sc.sample_period_s, sc.history_maxlen).start()


def _time_ticks(sched: Scheduler, rt: RoundTrips) -> list[tuple[float, float, float, int, int]]:
    """Wraps sched.tick: each tick appends (start time, seconds, thread CPU seconds, round trips, commands) to the
    list returned."""
    ticks: list[tuple[float, float, float, int, int]] = []
    tick = sched.tick

    def timed_tick(now: float | None = None):
        t_wall, t0, c0 = time.time(), time.perf_counter(), time.thread_time()
        trips, cmds = rt.trips + sched.sent.trips, rt.commands + sched.sent.commands  # + the packed reads
        try:
            return tick(now)
        finally:
            ticks.append((t_wall, time.perf_counter() - t0, time.thread_time() - c0,
                          rt.trips + sched.sent.trips - trips, rt.commands + sched.sent.commands - cmds))

    sched.tick = timed_tick
    return ticks


def monitor_main(args: argparse.Namespace) -> int:
    """The nodes' telemetry monitors of a many-node simulated cluster, in one process (SimulatedNodes)."""
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
    p = argparse.ArgumentParser(prog="python -m tailspec.benchmarks.scheduler_procs")
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



if __name__ == "__main__":
    sys.exit(main())
