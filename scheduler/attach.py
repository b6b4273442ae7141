"""Ray mode: join an existing Ray cluster with one detached scheduler actor and one telemetry actor per
node; sessions are started on demand as actors pinned to the lent GPU's node (dispatch.RayDispatcher).

All tailspec actors live in the Ray namespace "tailspec" and are named after the cluster, so `attach`
is idempotent (get_if_exists) and `detach` finds them again from any driver. Actors take no Ray
resources (num_cpus=0, num_gpus=0): the GPUs belong to the RL job.

Node names in the cluster state are the first 12 hex digits of the Ray node id; rollout workers in
Ray report progress under `ray_node_name()`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from tailspec.core.config import TailspecConfig
from tailspec.scheduler.dispatch import RayDispatcher
from tailspec.scheduler.monitor import TelemetryMonitor
from tailspec.scheduler.service import Scheduler
from tailspec.scheduler.telemetry import make_telemetry

log = logging.getLogger(__name__)

NAMESPACE = "tailspec"


def node_name(node_id: str) -> str:
    return node_id[:12]


def ray_node_name() -> str:
    """This process's node name (call inside a Ray worker or a connected driver)."""
    # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
    import ray

    return node_name(ray.get_runtime_context().get_node_id())


def scheduler_actor_name(cluster: str) -> str:
    return f"tailspec-scheduler-{cluster}"


def telemetry_actor_name(cluster: str, node: str) -> str:
    return f"tailspec-telemetry-{cluster}-{node}"


def _alive_nodes() -> list[dict[str, Any]]:
    # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


class _SchedulerActor:
    def __init__(self, cfg_json: str, redis_url: str):
        # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
        import ray

        cfg = TailspecConfig.model_validate_json(cfg_json)
        self.r = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        node_ids = {node_name(n["NodeID"]): n["NodeID"] for n in _alive_nodes()}
        self.dispatcher = RayDispatcher(
            cfg.scheduler.session_entry, node_ids, namespace=ray.get_runtime_context().namespace
        )
        self.sched = Scheduler(cfg, self.r, self.dispatcher, redis_url=redis_url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.sched.serve, args=(self._stop,), daemon=True)
        self._thread.start()

    def ping(self) -> dict[str, Any]:
        return {"ticks": self.sched.ticks, "errors": self.sched.errors, "live": sorted(self.sched.live),
                "role": self.sched.role if self.sched.ticks else "starting", "epoch": self.sched.epoch, "holder": self.sched.holder}

    def where(self) -> dict[str, dict[str, Any]]:
        """Placement of every live session actor: node id, CUDA_VISIBLE_DEVICES, pid."""
        # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
        import ray

        out = {}
        for sid in list(self.dispatcher.actors):
            h = self.dispatcher.handle(sid)
            if h is not None:
                try:
                    out[sid] = ray.get(h.where.remote(), timeout=10)
                except Exception as e:
                    out[sid] = {"error": str(e)}
        return out

    def shutdown(self) -> bool:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sched.shutdown()
        return True


class _TelemetryActor:
    def __init__(self, cfg_json: str, redis_url: str, node: str, num_gpus: int):

        cfg = TailspecConfig.model_validate_json(cfg_json)
        sc = cfg.scheduler
        self.r = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        telemetry, self.warning = make_telemetry(sc.telemetry, node, self.r, cfg.cluster.name, num_gpus,
                                                 simulated_mem=int(sc.simulated_gpu_mem_gib * (1 << 30)))
        self.monitor = TelemetryMonitor(
            telemetry, self.r, cfg.cluster.name, sc.sample_period_s, sc.history_maxlen, warning=self.warning
        ).start()

    def ping(self) -> dict[str, Any]:
        # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
        import ray

        t = self.monitor.telemetry
        return {
            "node": t.node,
            "node_id": ray.get_runtime_context().get_node_id(),
            "simulated": t.simulated,
            "gpus": t.gpu_ids(),
            "samples": self.monitor.samples,
            "warning": self.warning,
        }

    def shutdown(self) -> bool:
        self.monitor.stop()
        return True


def attach(cfg: TailspecConfig, redis_url: str, address: str | None = "auto") -> dict[str, Any]:
    """Start (or find) the scheduler actor and one telemetry actor per alive node. Returns a summary."""
    # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    cfg_json = cfg.model_dump_json()
    cluster = cfg.cluster.name
    tel_cls = ray.remote(num_cpus=0, num_gpus=0, max_restarts=-1)(_TelemetryActor)
    sched_cls = ray.remote(num_cpus=0, num_gpus=0, max_concurrency=4)(_SchedulerActor)
    pings = []
    for n in _alive_nodes():
        nid = n["NodeID"]
        name = node_name(nid)
        gpus = int(n.get("Resources", {}).get("GPU", 0)) or cfg.scheduler.simulated_gpus
        a = tel_cls.options(
            name=telemetry_actor_name(cluster, name),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=nid, soft=False),
        ).remote(cfg_json, redis_url, name, gpus)
        pings.append(a.ping.remote())
    sched = sched_cls.options(
        name=scheduler_actor_name(cluster), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(cfg_json, redis_url)
    telemetry = ray.get(pings, timeout=120)
    return {
        "cluster": cluster,
        "scheduler": scheduler_actor_name(cluster),
        "namespace": NAMESPACE,
        "scheduler_state": ray.get(sched.ping.remote(), timeout=120),
        "telemetry": telemetry,
    }


def tailspec_actor_names(cluster: str) -> list[str]:
    # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
    import ray

    prefix = (scheduler_actor_name(cluster), f"tailspec-telemetry-{cluster}-")
    names = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix):
            names.append(a["name"])
    return sorted(names)


def detach(cfg: TailspecConfig, address: str | None = "auto", timeout_s: float = 30.0) -> list[str]:
    """Shut down (revoking every lease) and kill this cluster's tailspec actors; returns their names."""
    # deferred: Ray (seconds to import); the single-node scheduler, its sessions and the CLI never load it
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    removed = []
    for name in tailspec_actor_names(cfg.cluster.name):
        try:
            a = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            ray.get(a.shutdown.remote(), timeout=timeout_s)
        except Exception as e:  # already dead or hung: kill anyway
            log.warning("detach: %s did not shut down cleanly: %s", name, e)
        ray.kill(a, no_restart=True)
        removed.append(name)
    return removed
