"""The demo's services: Redis, the scheduler, the dashboard and one rollout worker process per simulated GPU.

`Services.start` brings them up in that order (a worker reports progress to Redis from its first second; the
scheduler must be watching before the first rollout) and `stop` takes them down in reverse, each step
best-effort, so a failed run still leaves no process behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.demo.protocol import WorkItem, work_key

log = logging.getLogger("tailspec.demo")


@dataclass(frozen=True)
class Placement:
    """How the run's simulated GPUs share this host: `cpus[g]` are GPU g's own cores (None: all shared)."""
    workers: int
    cpus: list[list[int]] | None
    note: str


def place_workers(requested: int, cfg: TailspecConfig) -> Placement:
    """One simulated GPU per worker, each owning an equal share of the cores (scheduler/placement.py) under
    `scheduler.simulated_gpu_cpus: split`: at most one per core, so fewer than requested on a small machine.
    With CUDA the workers run on real devices and nothing is pinned."""
    from tailspec.scheduler import placement

    if torch.cuda.is_available():
        return Placement(requested, None, f"{requested} rollout workers on CUDA devices")
    host = placement.host_cpus()
    if cfg.scheduler.simulated_gpu_cpus != "split":
        return Placement(requested, None, f"{requested} simulated GPUs sharing {len(host)} cores "
                                          "(scheduler.simulated_gpu_cpus=shared)")
    n = placement.gpus_that_fit(requested, host)
    cpus = placement.split(n, host)
    fewer = f" ({requested} asked, {len(host)} cores)" if n < requested else ""
    per = len(cpus[0])
    return Placement(n, cpus, f"{n} simulated GPUs{fewer}, {per} own core{'s' if per > 1 else ''} each")


@dataclass
class Services:
    run_dir: Path
    cpus: list[list[int]] | None  # each worker's own cores (None: not pinned)
    redis_url: str | None = None  # None: start a private redis-server
    dashboard: bool = True
    dashboard_url: str | None = None
    r: object | None = None  # redis.Redis
    client: object | None = None  # TailspecClient
    procs: list[subprocess.Popen] = field(default_factory=list)
    _redis_server: object | None = None
    _sched_stop: threading.Event = field(default_factory=threading.Event)
    _sched_thread: threading.Thread | None = None
    _dash: object | None = None

    def start_redis(self) -> str:
        """Connect to the given Redis, or start a private redis-server; returns its URL."""
        import redis

        if self.redis_url is None:
            from tailspec.redis_server import start_redis

            self._redis_server = start_redis()
            self.redis_url = self._redis_server.url
        self.r = redis.Redis.from_url(self.redis_url)
        return self.redis_url

    def start(self, cfg: TailspecConfig, workers: int) -> None:
        """The scheduler (a thread running the single-node service), the dashboard and the workers; Redis must
        be up (start_redis) and `cfg` name it."""
        from tailspec.scheduler.client import TailspecClient
        from tailspec.scheduler.service import run_local

        cluster = cfg.cluster.name
        self.client = TailspecClient(self.redis_url, cluster=cluster, node=cfg.cluster.node)
        self._sched_thread = threading.Thread(
            target=run_local, args=(cfg, self._sched_stop, self.redis_url, str(self.run_dir / "sessions")),
            name="tailspec-scheduler", daemon=True)
        self._sched_thread.start()
        if self.dashboard:
            self._start_dashboard(cluster)
        for w in range(workers):
            self.procs.append(self._start_worker(w, cluster, cfg.cluster.node))

    def _start_dashboard(self, cluster: str) -> None:
        try:
            from tailspec.dashboards.server import start_dashboard

            self._dash = start_dashboard(self.redis_url, cluster, port=0)
            self.dashboard_url = self._dash.url
        except Exception as e:  # the dashboard is a view; the run goes on without it
            log.warning("dashboard not started: %s", e)

    def _start_worker(self, w: int, cluster: str, node: str) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "tailspec.demo.worker", "--name", f"w{w}", "--gpu", str(w),
               "--redis", self.redis_url, "--cluster", cluster, "--node", node]
        if self.cpus is not None:
            from tailspec.scheduler.placement import format_cpus

            cmd += ["--cpus", format_cpus(self.cpus[w])]
        with open(self.run_dir / f"worker-w{w}.log", "w") as logf:  # the child keeps its own descriptor
            return subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)

    def dead_workers(self) -> list[str]:
        return [f"w{i}" for i, p in enumerate(self.procs) if p.poll() is not None]

    def stop(self, cluster: str) -> None:
        """Workers (a stop item each, then kill after 10 s), scheduler, client, dashboard, Redis."""
        for w in range(len(self.procs)):
            try:
                self.r.rpush(work_key(cluster, f"w{w}"), state.encode(WorkItem(step=0, stop=True)))
            except Exception:  # Redis may be what failed; the kill below still runs
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self._sched_stop.set()
        if self._sched_thread is not None:
            self._sched_thread.join(timeout=10)
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # best effort: the run is over
                pass
        if self._dash is not None:
            self._dash.stop()
        if self._redis_server is not None:
            self._redis_server.stop()
