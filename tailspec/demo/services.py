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
import yaml

from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.redis_conn import connect
from tailspec.dashboards.server import start_dashboard
from tailspec.demo.protocol import WorkItem, work_key
from tailspec.redis_server import start_redis
from tailspec.scheduler import cpu_quota, placement
from tailspec.scheduler.client import TailspecClient
from tailspec.scheduler.placement import format_cpus
from tailspec.scheduler.service import run_local

log = logging.getLogger("tailspec.demo")


@dataclass(frozen=True)
class Placement:
    """How the run's simulated GPUs share this host: `cpus[g]` are GPU g's own cores (None: all shared) and
    `quota[g]` the fraction of them it may use (None: whole cores; scheduler/cpu_quota.py). On CUDA (`device`
    "cuda"), `env[g]` is what GPU g's worker and sessions start with: its CUDA device and MPS share
    (tailspec/demo/device_share.py); on the CPU of a machine with CUDA, no device at all."""
    workers: int
    cpus: list[list[int]] | None
    note: str
    quota: list[float] | None = None
    device: str = "cpu"
    env: list[dict[str, str]] | None = None


def resolve_device(device: str) -> str:
    """`auto`: CUDA where torch sees a device, else the CPU; `cuda` without one is an error naming the fix."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (a CPU build of torch, or no driver); "
                         "use --device cpu")
    return device


def place_workers(requested: int, cfg: TailspecConfig, device: str = "cpu", shares=None) -> Placement:
    """One simulated GPU per worker. On the CPU each has compute of its own (scheduler/placement.py) under
    `scheduler.simulated_gpu_cpus: split`: whole cores, or where a CPU quota can be set up to two GPUs per core at
    half of it each; fewer GPUs than requested on a machine too small for either. On CUDA nothing is pinned and
    the GPUs are the devices, or shares of them (`shares`, the run's DeviceShares: tailspec/demo/device_share.py)."""
    if device == "cuda":
        if shares is None or len(shares.env) != requested:
            raise ValueError(f"{requested} simulated GPUs on CUDA need their device shares planned (share_devices)")
        return Placement(requested, None, shares.sharing, device="cuda", env=shares.env)
    hide = [{"CUDA_VISIBLE_DEVICES": ""}] * requested if torch.cuda.is_available() else None  # the CPU, asked for
    placed = _place_on_cores(requested, cfg)
    return Placement(placed.workers, placed.cpus, placed.note, placed.quota, env=hide and hide[: placed.workers])


def _place_on_cores(requested: int, cfg: TailspecConfig) -> Placement:
    host = placement.host_cpus()
    if cfg.scheduler.simulated_gpu_cpus != "split":
        return Placement(requested, None, f"{requested} simulated GPUs sharing {len(host)} cores "
                                          "(scheduler.simulated_gpu_cpus=shared)")
    quota_root, why = cpu_quota.root()
    n = placement.gpus_that_fit(requested, host, quota=quota_root is not None)
    shares = placement.shares(n, host, quota=quota_root is not None)
    fewer = f" ({requested} asked, {len(host)} cores{'' if quota_root else '; no CPU quota: ' + why})" \
        if n < requested else ""
    if shares[0].fraction < 1:
        return Placement(n, [s.cpus for s in shares], f"{n} simulated GPUs{fewer}, {shares[0].fraction:g} of a core "
                         "each (CPU quota)", [s.fraction for s in shares])
    per = len(shares[0].cpus)
    return Placement(n, [s.cpus for s in shares], f"{n} simulated GPUs{fewer}, {per} own core{'s' if per > 1 else ''} each")


def trainer_threads(p: Placement) -> int:
    """The RL update's CPU threads (on CUDA: its host threads): every simulated GPU's cores. Between rollouts the trainer owns all the GPUs
    (their workers wait for work and every lent GPU is back), as a cluster's update runs on every GPU; on one
    thread the update would take a far larger share of the RL step than the field's 14-25% (generation is 75-86%
    of an RL step: ReSpec). On CUDA devices (nothing pinned) the host's cores, torch's own default."""
    if p.cpus is None:
        return len(placement.host_cpus())
    return len({c for cpus in p.cpus for c in cpus})


@dataclass
class Services:
    run_dir: Path
    placement: Placement  # each worker's own cores (None: not pinned) and CPU quota
    redis_url: str | None = None  # None: start a private redis-server
    dashboard: bool = True
    # 0: the scheduler runs as a thread of this process. n >= 1: n `tailspec scheduler run` processes (one
    # leads, the others stand by), which a fault drill can SIGKILL one by one.
    schedulers: int = 0
    redis_aof: bool = False  # the private redis-server appends to an AOF (fsync every second): restartable
    dashboard_url: str | None = None
    r: object | None = None  # redis.Redis
    client: object | None = None  # TailspecClient
    procs: list[subprocess.Popen] = field(default_factory=list)
    _redis_server: object | None = None
    sched_procs: list[subprocess.Popen] = field(default_factory=list)
    _cfg_file: Path | None = None
    _sched_stop: threading.Event = field(default_factory=threading.Event)
    _sched_thread: threading.Thread | None = None
    _dash: object | None = None
    _cgroups: list[str] = field(default_factory=list)  # each worker's CPU quota (GPU w's cgroup)

    def start_redis(self) -> str:
        """Connect to the given Redis, or start a private redis-server; returns its URL."""
        if self.redis_url is None:
            self._redis_server = start_redis(aof=self.redis_aof)
            self.redis_url = self._redis_server.url
        self.r = connect(self.redis_url)  # rides out a Redis restart
        return self.redis_url

    @property
    def redis_server(self):
        """The private redis-server (tailspec.redis_server.RedisServer), or None for a given Redis."""
        return self._redis_server

    def start(self, cfg: TailspecConfig, workers: int) -> None:
        """The scheduler (a thread running the single-node service), the dashboard and the workers; Redis must
        be up (start_redis) and `cfg` name it."""
        cluster = cfg.cluster.name
        self.client = TailspecClient(self.redis_url, cluster=cluster, node=cfg.cluster.node)
        if self.schedulers:
            self._cfg_file = self.run_dir / "scheduler-config.yaml"
            self._cfg_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
            for i in range(self.schedulers):
                self.sched_procs.append(self.start_scheduler(i))
        else:
            self._sched_thread = threading.Thread(
                target=run_local, args=(cfg, self._sched_stop, self.redis_url, str(self.run_dir / "sessions")),
                name="tailspec-scheduler", daemon=True)
            self._sched_thread.start()
        if self.dashboard:
            self._start_dashboard(cluster)
        if self.placement.quota:  # the same cgroups the scheduler's sessions join (scheduler.service)
            self._cgroups = [cpu_quota.create(cpu_quota.name_for(cluster, w), q)
                             for w, q in enumerate(self.placement.quota)]
        for w in range(workers):
            self.procs.append(self._start_worker(w, cluster, cfg.cluster.node))

    def _start_dashboard(self, cluster: str) -> None:
        try:
            self._dash = start_dashboard(self.redis_url, cluster, port=0)
            self.dashboard_url = self._dash.url
        except Exception as e:  # the dashboard is a view; the run goes on without it
            log.warning("dashboard not started: %s", e)

    def start_scheduler(self, i: int) -> subprocess.Popen:
        """A `tailspec scheduler run` process on the run's config (it leads or stands by)."""
        cmd = [sys.executable, "-m", "tailspec.cli", "scheduler", "run", "--config", str(self._cfg_file),
               "--redis", self.redis_url, "--session-logs", str(self.run_dir / "sessions")]
        with open(self.run_dir / f"scheduler-{i}.log", "a") as logf:
            return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)

    def restart_worker(self, w: int, cluster: str, node: str) -> None:
        """Replace worker `w`'s process (after it died): same name, GPU and cores."""
        old = self.procs[w]
        if old.poll() is None:
            old.kill()
            old.wait(10)
        self.procs[w] = self._start_worker(w, cluster, node)

    def _start_worker(self, w: int, cluster: str, node: str) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        if self.placement.env is not None:
            env.update(self.placement.env[w])
        cmd = [sys.executable, "-m", "tailspec.demo.worker", "--name", f"w{w}", "--gpu", str(w),
               "--redis", self.redis_url, "--cluster", cluster, "--node", node, "--device", self.placement.device]
        if self.placement.cpus is not None:
            cmd += ["--cpus", format_cpus(self.placement.cpus[w])]
        if self._cgroups:
            cmd += ["--cgroup", self._cgroups[w]]
        with open(self.run_dir / f"worker-w{w}.log", "a") as logf:  # the child keeps its own descriptor
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
        for p in self.sched_procs:  # SIGTERM: each revokes its leases and stops its sessions
            if p.poll() is None:
                p.terminate()
        for p in self.sched_procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # best effort: the run is over
                pass
        if self._dash is not None:
            self._dash.stop()
        if self._redis_server is not None:
            self._redis_server.stop()
        for cg in self._cgroups:
            cpu_quota.remove(cg)
