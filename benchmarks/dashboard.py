"""Dashboard benchmark: latency of /metrics, /api/state and /api/timeline over a large cluster state.

Fills a private redis-server through the cluster-state schema (GPUs, a full telemetry history stream,
GPU state transitions, sessions, drafter versions, rollout figures), starts the web dashboard and the
exporter, and times HTTP GETs of each endpoint as a browser or Prometheus would make them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import urllib.request

from tailspec.benchmarks.machine import machine
from tailspec.core import state as S
from tailspec.core.state import (
    DrafterVersion,
    GpuState,
    GpuStatus,
    GpuTelemetry,
    PhaseInfo,
    RolloutStats,
    SessionInfo,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=64, help="GPUs in the cluster (default 64: 8 nodes × 8)")
    p.add_argument("--history", type=int, default=20_000,
                   help="telemetry history stream length (default 20000, the scheduler's default cap)")
    p.add_argument("--transitions", type=int, default=5_000, help="GPU state transitions in the history")
    p.add_argument("--sessions", type=int, default=1_000, help="session records")
    p.add_argument("--repeats", type=int, default=20, help="GETs per endpoint (default 20)")


def fill(r, cluster: str, gpus: int, history: int, transitions: int, sessions: int, seed: int = 0) -> float:
    """Write a realistic state; returns the time span (s) the histories cover, ending now."""
    rng = random.Random(seed)
    now = time.time()
    ids = [(f"node{i // 8}", i % 8) for i in range(gpus)]
    span = history / max(1, gpus) * 0.2  # a sample per GPU every 0.2 s (the monitor's default period)
    pipe = r.pipeline(transaction=False)
    for i in range(history):
        node, g = ids[i % gpus]
        t = GpuTelemetry(node=node, gpu=g, util=rng.uniform(0, 100), mem_used=rng.randrange(80 << 30),
                         mem_total=80 << 30, simulated=True, ts=now - span + span * i / history)
        pipe.xadd(S.key(cluster, "telemetry_history"), {"data": S.encode(t)})
        if i >= history - gpus:
            pipe.set(S.key(cluster, "telemetry", node=node, gpu=g), S.encode(t))
            pipe.sadd(S.key(cluster, "gpus"), f"{node}:{g}")
    states = list(GpuState)
    for i in range(transitions):
        node, g = ids[i % gpus]
        st = GpuStatus(node=node, gpu=g, state=rng.choice(states), since=now - span + span * i / transitions)
        pipe.xadd(S.key(cluster, "status_history"), {"data": S.encode(st)})
        if i >= transitions - gpus:
            pipe.set(S.key(cluster, "gpu_status", node=node, gpu=g), S.encode(st))
    for i in range(sessions):
        node, g = ids[i % gpus]
        s = SessionInfo(session_id=f"s{i}", node=node, gpu=g, lease_token=i + 1, status="stopped", step=100,
                        loss=1.0, started_at=now - span + i, stop_latency_s=rng.expovariate(5.0))
        pipe.set(S.key(cluster, "session", session_id=s.session_id), S.encode(s))
        pipe.sadd(S.key(cluster, "sessions"), s.session_id)
    for v in range(100):
        d = DrafterVersion(version=v, path=f"v{v}", policy_version=v, acceptance_length=2 + v / 100,
                           promoted=v % 3 != 2, created_at=now)
        pipe.rpush(S.key(cluster, "drafter_versions"), S.encode(d))
    for step in range(500):
        st = RolloutStats(worker=f"w{step % 8}", step=step // 8, tokens=10_000, seconds=5.0, target_forwards=4_000,
                          drafted=12_000, accepted=6_000, acceptance_length=2.5, strategy_mix={"0": 3, "4": 7},
                          baseline_tokens_per_s=1_000.0, ts=now)
        pipe.xadd(S.key(cluster, "rollout_stats"), {"data": S.encode(st)})
    pipe.set(S.key(cluster, "phase"), S.encode(PhaseInfo(phase="rollout", step=62, started_at=now)))
    pipe.hset(S.key(cluster, "counters"), mapping={"idle_gpu_seconds": 1e5, "lent_gpu_seconds": 6e4})
    pipe.execute()
    return span


def _time_get(url: str, repeats: int) -> dict:
    times, size = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as resp:
            size = len(resp.read())
        times.append(time.perf_counter() - t0)
    return {"p50_ms": round(1000 * statistics.median(times), 2), "max_ms": round(1000 * max(times), 2),
            "bytes": size}


def run(args: argparse.Namespace) -> dict:
    # deferred: the CLI imports every bench module to build its parser; this loads when the bench runs
    import redis
    from tailspec.dashboards.server import start_dashboard, start_exporter

    from tailspec.redis_server import start_redis

    out = sys.stderr if args.json else sys.stdout
    with start_redis() as srv:
        r = redis.Redis.from_url(srv.url)
        t0 = time.perf_counter()
        span = fill(r, "bench", args.gpus, args.history, args.transitions, args.sessions)
        print(f"filled state in {time.perf_counter() - t0:.1f}s: {args.gpus} GPUs, {args.history} telemetry "
              f"samples over {span:.0f}s, {args.transitions} transitions, {args.sessions} sessions", file=out)
        web, exp = start_dashboard(srv.url, "bench"), start_exporter(srv.url, "bench")
        try:
            results = {
                "metrics": _time_get(exp.url + "/metrics", args.repeats),
                "api_state": _time_get(web.url + "/api/state", args.repeats),
                "api_timeline_60s": _time_get(web.url + "/api/timeline?window=60", args.repeats),
                "api_timeline_full": _time_get(web.url + f"/api/timeline?window={max(1, int(span) + 1)}",
                                               args.repeats),
            }
        finally:
            web.stop()
            exp.stop()
    print(f"{'endpoint':<20}{'p50 ms':>10}{'max ms':>10}{'bytes':>12}", file=out)
    for name, v in results.items():
        print(f"{name:<20}{v['p50_ms']:>10.1f}{v['max_ms']:>10.1f}{v['bytes']:>12}", file=out)
    print(f"on {machine()}", file=out)
    return {"device": machine(), "gpus": args.gpus, "history": args.history, "transitions": args.transitions,
            "sessions": args.sessions, "history_span_s": round(span, 1), **results}
