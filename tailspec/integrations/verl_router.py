"""Per-replica rollout progress from verl's request load balancer (verl==0.9.1, the `verl` extra).

verl routes every generation request of its agent loops through one load balancer actor: `acquire_server`
before a request goes to a vLLM server replica, `release_server` when it is back. So that actor knows, at any
moment, how many requests each replica has in flight. verl lets a run replace the balancer by configuration,
without touching verl's code: `actor_rollout_ref.rollout.router_config_path` names a YAML file whose
`router_class` verl imports and starts as a Ray actor with `(servers, whole_file_as_dict)`
(verl.workers.rollout.router.get_router_handle). `TailspecLoadBalancer` is such a class: a subclass of verl's
default `GlobalRequestLoadBalancer` (same sticky, least-in-flight routing; its methods are called unchanged)
that also reports each replica's in-flight, started and finished requests through tailspec's client
(`report_progress`, worker `<prefix>-<n>`, on the node and GPUs the replica's server runs on).

A replica is located once, when it is registered: its server actor (verl's `vLLMHttpServer`) runs on the
replica's node with `CUDA_VISIBLE_DEVICES` set to the replica's GPUs there; Ray's `__ray_call__` reads both
from inside the actor. A replica spread over several nodes is reported with its first node's GPUs.

Memory: a drained replica keeps its vLLM weights and KV cache until verl puts every replica to sleep after the
batch, so progress says nothing about memory (`mem_released` None): the scheduler lends a drained replica's
GPU only where its measured free memory fits a session.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

from tailspec.integrations.verl_config import VerlSettings
from tailspec.scheduler.attach import node_name, ray_node_name
from tailspec.scheduler.client import TailspecClient

log = logging.getLogger(__name__)

Placement = Callable[[Any], tuple[str, list[int]]]  # server handle -> (tailspec node name, GPU indices)


def _where(actor: Any) -> tuple[str, str]:
    """Runs inside the server actor (through `__ray_call__`): its Ray node and visible GPUs."""
    return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES", "")


def ray_placement(server: Any, timeout_s: float = 60.0) -> tuple[str, list[int]]:
    """Where a verl server actor runs: the node name tailspec's Ray attach uses and the GPU indices verl made
    visible to it (its replica's GPUs on that node)."""
    node_id, devices = ray.get(server.__ray_call__.remote(_where), timeout=timeout_s)
    gpus = [int(d) for d in devices.split(",") if d.strip().isdigit()]
    return node_name(node_id), gpus


class TailspecLoadBalancer(GlobalRequestLoadBalancer):
    """verl's default load balancer plus per-replica progress reports (module doc). Also usable as
    `LLMServerManager(load_balancer_cls=...)`; then `config` is None and `settings` or `client` are given."""

    def __init__(self, servers: dict[str, Any], config: dict | None = None, *, settings: VerlSettings | None = None,
                 client: Any = None, placement: Placement | None = None):
        cfg = dict(config or {})
        super().__init__(servers, max_cache_size=int(cfg.get("max_cache_size", DEFAULT_ROUTING_CACHE_SIZE)),
                         full_determinism=bool(cfg.get("full_determinism", False)))
        self.settings = settings or VerlSettings.from_mapping(cfg.get("tailspec"))
        if client is None:  # inside the Ray actor: reported under its own node's name
            client = TailspecClient(self.settings.redis_url, cluster=self.settings.cluster, node=ray_node_name())
        self.client = client
        self.placement = placement or ray_placement
        self.step = 0
        self.started: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.workers: dict[str, str] = {}  # server id -> tailspec worker name
        self.where: dict[str, tuple[str, list[int]]] = {}
        self._seen = 0
        self._locate(servers)

    # -- verl's interface: routing unchanged, then a report --------------------------------------------
    def acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        server_id, handle = super().acquire_server(request_id, **extra)
        self.started[server_id] += 1
        self._report(server_id)
        return server_id, handle

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        counted = self._inflight_requests.get(server_id, 0) > 0
        super().release_server(server_id, request_id)
        if counted:
            self.finished[server_id] += 1
            self._report(server_id)

    def add_servers(self, servers: dict[str, Any]) -> None:
        super().add_servers(servers)
        self._locate(servers)

    def remove_servers(self, server_ids: list[str]) -> None:
        for sid in server_ids:  # a removed replica decodes nothing more: say so before forgetting it
            if sid in self.workers:
                self._report(sid, active=0)
        super().remove_servers(server_ids)

    # -- tailspec's calls, from the driver's agent-loop manager -----------------------------------------
    def tailspec_begin(self, step: int) -> None:
        """A new generation batch: counts start at zero for RL step `step`."""
        self.step, self.started, self.finished = int(step), Counter(), Counter()
        for sid in self._inflight_requests:
            self._report(sid)

    def tailspec_end(self) -> dict[str, dict]:
        """The batch is back: report every replica once more and return what each saw."""
        for sid in self._inflight_requests:
            self._report(sid)
        self.client.flush(2.0)
        return self.tailspec_loads()

    def tailspec_loads(self) -> dict[str, dict]:
        return {sid: {"worker": self.workers.get(sid), "inflight": n, "started": self.started[sid],
                      "finished": self.finished[sid], "where": self.where.get(sid)}
                for sid, n in self._inflight_requests.items()}

    def tailspec_servers(self) -> dict[str, Any]:
        """The registered server handles (one per replica): where drafter reloads go."""
        return dict(self._servers)

    # -- internals --------------------------------------------------------------------------------------
    def _locate(self, servers: dict[str, Any]) -> None:
        for sid, handle in servers.items():
            if sid not in self.workers:
                self.workers[sid] = f"{self.settings.worker_prefix}-{self._seen}"
                self._seen += 1
            try:
                self.where[sid] = self.placement(handle)
            except Exception as e:  # noqa: BLE001 - an unplaced replica is reported on no GPU, never lent
                log.warning("tailspec: could not locate verl server %s (%s); its progress names no GPU", sid, e)
                self.where[sid] = (self.client.node, [])

    def _report(self, server_id: str, active: int | None = None) -> None:
        node, gpus = self.where.get(server_id, (self.client.node, []))
        inflight = self._inflight_requests.get(server_id, 0) if active is None else active
        started = self.started[server_id]
        try:  # best effort: a report must never fail a request's routing
            self.client.report_progress(self.workers[server_id], gpus, active=inflight,
                                        finished=self.finished[server_id], phase="rollout", node=node,
                                        total=max(started, inflight + self.finished[server_id]), step=self.step)
        except (ValueError, TypeError) as e:
            log.warning("tailspec: progress of %s not reported: %s", server_id, e)
