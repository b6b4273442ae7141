"""Start and stop trainer sessions on lent GPUs.

`LocalDispatcher` (single node: the demo and most tests) runs each session as a child process
`python -m tailspec.scheduler.session_process`; `RayDispatcher` runs it as a Ray actor pinned to the GPU's
node. Either way the session sees only its GPU (CUDA_VISIBLE_DEVICES, PCI bus order like NVML), gets
its SessionContext as JSON, and stops on its own when its lease is revoked; the dispatcher's `stop`
is the backstop after the deadline (SIGTERM, then SIGKILL / ray.kill).

`num_gpus=0` in Ray's accounting: the GPU belongs to the RL job's placement group; the session only
borrows it while the RL job leaves it idle.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailspec.scheduler import cpu_quota
from tailspec.scheduler.cpu_quota import CGROUP_ENV
from tailspec.scheduler.placement import CPUS_ENV, format_cpus, pin_process
from tailspec.scheduler.session_process import (
    CONTEXT_ENV,
    DONE_ENV,
    NICE_ENV,
    READY_ENV,
    SessionContext,
    run_context,
)

log = logging.getLogger(__name__)


def session_env(ctx: SessionContext, entry: str) -> dict[str, str]:
    return {
        "CUDA_VISIBLE_DEVICES": str(ctx.gpu),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # same numbering as NVML's device index
        CONTEXT_ENV: ctx.to_json(),
        "TAILSPEC_SESSION_ENTRY": entry,
    }


class Dispatcher(Protocol):
    def start(self, ctx: SessionContext) -> None: ...

    def stop(self, session_id: str) -> None: ...

    def cancel(self, session_id: str) -> None: ...

    def poll(self) -> set[str]: ...

    def shutdown(self) -> None: ...


@dataclass
class _Proc:
    ctx: SessionContext
    proc: subprocess.Popen
    log_path: str
    terminated_at: float | None = None
    done_path: str | None = None  # a warm process: it writes the exit code here and waits for the next session
    stop_at: float | None = None  # a warm process's session passed its stop deadline (stop(): SIGTERM later)


@dataclass
class LocalDispatcher:
    """`warm` > 0 keeps a pool of that many session processes pre-started with the entry imported (torch and the
    model code take seconds to import on a busy machine — often longer than the tail a GPU is lent for);
    a lent GPU then starts training within a fraction of a second. Warm processes hold no GPU. A warm process
    serves one session after another: when its session ends it writes the exit code to a `.done` file in
    `log_dir` and goes back to the idle pool (on real GPUs for the GPU its CUDA context is on only), so imports
    are paid once per process, not once per lend."""

    entry: str
    log_dir: str | None = None
    kill_grace_s: float = 2.0
    # A warm process whose session passed its stop deadline gets this long to stop on its own lease check before
    # SIGTERM: the GPU counts as reclaimed at the deadline either way, and SIGTERM ends the process, whose
    # replacement then imports for seconds on the lent GPU's compute (and a lend handed to it meanwhile waits).
    warm_stop_grace_s: float = 10.0
    extra_env: dict[str, str] = field(default_factory=dict)
    warm: int = 0
    nice: int = 0  # scheduler.session_nice: applied by the session process itself (see session_process.main)
    # Simulated GPUs that own CPU cores (scheduler/placement.py): GPU index → its cores. A session lent on
    # GPU g pins itself there (placement.place_from_env), so it trains on g's cores and no other GPU's.
    gpu_cpus: dict[int, list[int]] | None = None
    # ... and where simulated GPUs share a core, GPU index → its CPU quota's cgroup (scheduler/cpu_quota.py),
    # which the session joins with the GPU's rollout worker
    gpu_cgroups: dict[int, str] | None = None
    # Simulated GPUs that are shares of real CUDA devices: GPU index → the environment its sessions start with,
    # over session_env's (the real device's CUDA_VISIBLE_DEVICES, its CUDA MPS share: scheduler.simulated_gpu_env)
    gpu_env: dict[int, dict[str, str]] | None = None

    def __post_init__(self) -> None:
        self.procs: dict[str, _Proc] = {}
        self.ended: dict[str, int] = {}  # session id → exit code
        self._warm: list[tuple[subprocess.Popen, str]] = []  # idle warm processes, oldest first
        # pid → the GPU an idle warm process ran its last session on: CUDA initialised there, so on real GPUs it
        # serves that GPU only (simulated GPUs have no CUDA state: any process serves any GPU)
        self._served: dict[int, int] = {}
        self._closing = False
        self._warm_seq = 0
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="tailspec-sessions-")
        os.makedirs(self.log_dir, exist_ok=True)
        self._refill()

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.nice:
            env[NICE_ENV] = str(self.nice)
        env.update(self.extra_env)
        return env

    def _refill(self, cpus: list[int] | None = None, cgroup: str | None = None) -> None:
        """Start warm processes until the pool has `warm` (one died, or at start). `cpus`: the cores a
        replacement imports on — those of the GPU being lent (its session is the only other user there), so
        the seconds of imports never run on a core another GPU's tail is decoding on."""
        self._warm = [(p, lp) for p, lp in self._warm if p.poll() is None]
        # `warm` is the pool's size: idle processes plus warm processes running a session (they come back).
        # On real GPUs, an idle process that served another GPU does not count for a new GPU's lend.
        busy = sum(1 for p in self.procs.values() if p.done_path is not None)
        while sum(1 for p, _ in self._warm if self.gpu_cpus or p.pid not in self._served) + busy < self.warm:
            self._warm_seq += 1
            log_path = os.path.join(self.log_dir or ".", f"warm-{os.getpid()}-{self._warm_seq}.log")
            env = self._base_env()
            env.pop("CUDA_VISIBLE_DEVICES", None)  # chosen at assignment
            env.pop(CPUS_ENV, None)
            env.pop(CGROUP_ENV, None)
            if cpus:
                env[CPUS_ENV] = format_cpus(cpus)
            if cgroup:
                env[CGROUP_ENV] = cgroup
            env[READY_ENV] = log_path[: -len(".log")] + ".ready"
            with open(log_path, "ab") as logf:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tailspec.scheduler.session_process", "--warm", self.entry],
                    env=env, stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT,
                )
            self._warm.append((proc, log_path))

    def _cores(self, gpu: int) -> list[int] | None:
        """The simulated GPU's own cores, or None when GPUs own no cores."""
        if not self.gpu_cpus:
            return None
        cpus = self.gpu_cpus.get(gpu)
        if cpus is None:
            raise ValueError(f"simulated GPU {gpu} owns no cores (placement covers GPUs {sorted(self.gpu_cpus)})")
        return cpus

    def _take_warm(self, gpu: int) -> tuple[subprocess.Popen, str] | None:
        """An idle warm process for `gpu`, one whose imports are done first (a process still importing starts the
        session only when they are)."""
        self._warm = [(p, lp) for p, lp in self._warm if p.poll() is None]
        self._warm.sort(key=lambda w: not os.path.exists(w[1][: -len(".log")] + ".ready"))  # stable: oldest first
        for match in (lambda p: self._served.get(p.pid) == gpu, lambda p: p.pid not in self._served,
                      lambda p: bool(self.gpu_cpus)):
            for i, (p, _) in enumerate(self._warm):
                if match(p):
                    self._served.pop(p.pid, None)
                    return self._warm.pop(i)
        return None

    def start(self, ctx: SessionContext) -> None:
        cores = self._cores(ctx.gpu)
        cgroup = (self.gpu_cgroups or {}).get(ctx.gpu)
        placement = {CPUS_ENV: format_cpus(cores)} if cores else {}
        if cgroup:
            placement[CGROUP_ENV] = cgroup
        placement.update((self.gpu_env or {}).get(ctx.gpu, {}))
        taken = self._take_warm(ctx.gpu)
        if taken is not None:
            proc, log_path = taken
            if cores:  # at once: a process still importing reads its assignment (and pins) only after
                pin_process(proc.pid, cores)
            if cgroup:
                cpu_quota.join(cgroup, proc.pid)
            done = os.path.join(self.log_dir or ".", f"{ctx.session_id}.done")
            msg = {"env": {**self.extra_env, **session_env(ctx, self.entry), **placement, DONE_ENV: done},
                   "context": json.loads(ctx.to_json())}
            try:
                proc.stdin.write((json.dumps(msg) + "\n").encode())
                proc.stdin.flush()
                self.procs[ctx.session_id] = _Proc(ctx, proc, log_path, done_path=done)
                self._refill(cores, cgroup)
                return
            except OSError:  # it died meanwhile: fall back to a cold start
                proc.kill()
        env = self._base_env()
        env.update(session_env(ctx, self.entry))
        env.update(placement)
        log_path = os.path.join(self.log_dir or ".", f"{ctx.session_id}.log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tailspec.scheduler.session_process"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )
        self.procs[ctx.session_id] = _Proc(ctx, proc, log_path)
        self._refill(cores)

    def cancel(self, session_id: str) -> None:
        """A session revoked before it trained (still loading). A warm process's session is left to notice at
        its next lease check (a fraction of a second: start-up renews between its phases): SIGTERM would end
        the process, and the next lend would pay its imports again. A cold process is stopped now."""
        p = self.procs.get(session_id)
        if p is not None and p.done_path is None:
            self.stop(session_id)

    def stop(self, session_id: str) -> None:
        """Backstop after the deadline: the session should already have stopped on its lease check. A cold process
        is terminated now; a warm one after `warm_stop_grace_s` more (poll), unless its session ends first."""
        p = self.procs.get(session_id)
        if p is None or p.proc.poll() is not None or p.terminated_at is not None:
            return
        if p.done_path is not None and p.stop_at is None and not self._closing:
            p.stop_at = time.monotonic()
            return
        if p.done_path is None or self._closing or time.monotonic() - p.stop_at >= self.warm_stop_grace_s:
            p.proc.terminate()
            p.terminated_at = time.monotonic()

    def poll(self) -> set[str]:
        """Session ids whose session has ended: its process exited, or a warm process wrote its exit code and
        went back to the idle pool (all since start; `forget` drops them)."""
        for sid, p in list(self.procs.items()):
            rc = p.proc.poll()
            if rc is not None:
                self.ended[sid] = rc
                del self.procs[sid]
            elif p.done_path is not None and os.path.exists(p.done_path):
                try:
                    with open(p.done_path) as f:
                        self.ended[sid] = int(f.read().strip() or 0)
                    os.unlink(p.done_path)
                except (OSError, ValueError):
                    self.ended[sid] = 0
                del self.procs[sid]
                if p.terminated_at is None and not self._closing:
                    self._served[p.proc.pid] = p.ctx.gpu
                    self._warm.append((p.proc, p.log_path))
                else:
                    self._end_warm(p.proc)
            elif p.terminated_at is not None and time.monotonic() - p.terminated_at > self.kill_grace_s:
                p.proc.kill()
            elif p.stop_at is not None and p.terminated_at is None:
                self.stop(sid)  # a warm session past its deadline: SIGTERM once its grace is over
        return set(self.ended)

    def forget(self, session_id: str) -> None:
        self.ended.pop(session_id, None)

    def pid(self, session_id: str) -> int | None:
        p = self.procs.get(session_id)
        return p.proc.pid if p else None

    def _end_warm(self, proc: subprocess.Popen) -> None:
        try:  # EOF on stdin ends an idle warm process without running anything
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(self.kill_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()

    def shutdown(self) -> None:
        self._closing = True  # from now on a warm process whose session ends is ended, not pooled
        for proc, _ in self._warm:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc, _ in self._warm:
            self._end_warm(proc)
        self._warm.clear()
        for sid in list(self.procs):
            self.stop(sid)
        deadline = time.monotonic() + self.kill_grace_s
        while self.procs and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.02)
        for p in self.procs.values():
            p.proc.kill()
            p.proc.wait(5)
        self.poll()


def warm_ready(log_dir: str | os.PathLike) -> int:
    """How many warm session processes started with this log directory have finished their imports."""
    try:
        return sum(1 for name in os.listdir(log_dir) if name.startswith("warm-") and name.endswith(".ready"))
    except OSError:
        return 0


def _session_actor_class():
    # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
    import ray

    @ray.remote(num_gpus=0, num_cpus=0, max_restarts=0, max_concurrency=2)  # 2: where() answers during run()
    class SessionActor:
        """Runs one session in a Ray worker process on the GPU's node."""

        def run(self, ctx_json: str, entry: str) -> int:
            ctx = SessionContext.from_json(ctx_json)
            # Ray may have set CUDA_VISIBLE_DEVICES for a num_gpus=0 actor; the lent GPU wins.
            os.environ["CUDA_VISIBLE_DEVICES"] = str(ctx.gpu)
            os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            return run_context(ctx, entry)

        def where(self) -> dict[str, Any]:
            # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
            import ray as _ray

            return {
                "node_id": _ray.get_runtime_context().get_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "pid": os.getpid(),
            }

    return SessionActor


@dataclass
class RayDispatcher:
    """Sessions as Ray actors. `node_ids` maps tailspec node names to Ray node ids (hex); a name that
    is not in the map is taken to be a Ray node id itself."""

    entry: str
    node_ids: dict[str, str] = field(default_factory=dict)
    namespace: str | None = None

    def __post_init__(self) -> None:
        self.actors: dict[str, tuple[Any, Any]] = {}  # session id → (actor handle, run ref)
        self.ended: dict[str, int] = {}
        self._cls = _session_actor_class()

    def start(self, ctx: SessionContext) -> None:
        # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = self._node_id(ctx.node)
        actor = self._cls.options(
            name=f"tailspec-session-{ctx.session_id}",
            namespace=self.namespace,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={
                "env_vars": {
                    "CUDA_VISIBLE_DEVICES": str(ctx.gpu),
                    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                }
            },
        ).remote()
        self.actors[ctx.session_id] = (actor, actor.run.remote(ctx.to_json(), self.entry))

    def _node_id(self, node: str) -> str:
        if node not in self.node_ids:  # a node that joined after attach: look again
            # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
            import ray

            for n in ray.nodes():
                if n.get("Alive") and n["NodeID"].startswith(node):
                    self.node_ids[node] = n["NodeID"]
        return self.node_ids.get(node, node)

    def handle(self, session_id: str) -> Any:
        a = self.actors.get(session_id)
        return a[0] if a else None

    def cancel(self, session_id: str) -> None:
        self.stop(session_id)

    def stop(self, session_id: str) -> None:
        # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
        import ray

        a = self.actors.get(session_id)
        if a is not None:
            ray.kill(a[0], no_restart=True)

    def poll(self) -> set[str]:
        # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
        import ray

        if self.actors:
            refs = {ref: sid for sid, (_, ref) in self.actors.items()}
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in done:
                sid = refs[ref]
                try:
                    rc = int(ray.get(ref))
                except Exception:  # killed or crashed actor
                    rc = -9
                self.ended[sid] = rc
                actor = self.actors.pop(sid)[0]
                try:
                    ray.kill(actor, no_restart=True)  # free the worker process
                except Exception:
                    pass
        return set(self.ended)

    def forget(self, session_id: str) -> None:
        self.ended.pop(session_id, None)

    def shutdown(self) -> None:
        # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
        import ray

        for actor, _ in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors.clear()
