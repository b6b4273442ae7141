"""Per-node telemetry monitor: sample every GPU each period into the cluster state.

Writes `gpu:{node}:{gpu}` (latest sample, expiring so a dead monitor's GPUs turn UNKNOWN), adds the GPU
to `gpus`, appends to the capped `history:gpu` stream for timelines, and writes the node's `gpu_health:{node}`
(which GPUs it sampled and their errors, expiring with the samples): the scheduler reads that every tick and a
GPU's sample only while the GPU is drained (scheduler/observe.py). A Redis error is counted and logged; the loop
never dies of it.

Simulated telemetry is also sampled at once when the cluster's phase channel carries a message (a phase change or a
worker's drain, published by the client: scheduler/client_writer.py), on the grid otherwise. Its utilisation is a
function of the workers' progress and the leases, so a sample taken at the drain is the one the idle detector waits
for; the grid then sets only how stale a sample may get between events, not how soon a drained GPU is seen. NVML
telemetry keeps the grid alone: the utilisation it reads at a drain still averages the period before it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tailspec.core import state
from tailspec.core.state import Event, GpuTelemetry, NodeHealth
from tailspec.scheduler.phase_wake import PhaseWake
from tailspec.scheduler.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass
class TelemetryMonitor:
    telemetry: Telemetry
    r: Any
    cluster: str
    period_s: float = 0.2
    history_maxlen: int = 20_000
    warning: str | None = None  # published once as an event (e.g. "using SIMULATED telemetry")
    wake_on_events: bool = True  # simulated telemetry only: sample at once on the phase channel's messages
    errors: int = 0
    samples: int = 0
    last: list[GpuTelemetry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake: PhaseWake | None = None
        self._warned = False

    def sample_once(self) -> list[GpuTelemetry]:
        samples = self.telemetry.sample()
        c = self.cluster
        ttl_ms = int(max(2.0, 10 * self.period_s) * 1000)
        pipe = self.r.pipeline(transaction=False)
        publish_samples(pipe, c, samples, ttl_ms, self.history_maxlen)
        if self.warning and not self._warned:
            pipe.xadd(
                state.key(c, "events"),
                {
                    "data": state.encode(
                        Event(kind="warning", node=self.telemetry.node, detail={"message": self.warning})
                    )
                },
                maxlen=self.history_maxlen,
                approximate=True,
            )
        pipe.execute()
        self._warned = True
        self.samples += 1
        self.last = samples
        return samples

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or self._stop
        wake = self._wake
        next_t = time.monotonic()
        while not stop.is_set():
            try:
                self.sample_once()
            except Exception as e:  # Redis down, a telemetry bug: count, log, keep sampling
                self.errors += 1
                if self.errors in (1, 10) or self.errors % 100 == 0:
                    log.warning(
                        "telemetry monitor on %s: %s (%d errors)", self.telemetry.node, e, self.errors
                    )
            next_t += self.period_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (loaded machine): skip missed periods instead of bursting
                next_t, delay = time.monotonic(), 0
            if wake is None:
                stop.wait(delay)
            elif wake.wait(delay):  # a phase change or a drain: sample now, and the grid goes on from here
                next_t = time.monotonic()

    def start(self) -> "TelemetryMonitor":
        if self.wake_on_events and self.telemetry.simulated:
            self._wake = PhaseWake(self.r, state.key(self.cluster, "phase"), self._stop).start()
        self._thread = threading.Thread(target=self.run, name=f"telemetry-{self.telemetry.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._wake is not None:
            self._wake.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.telemetry.close()


def publish_samples(client: Any, cluster: str, samples: list[GpuTelemetry], ttl_ms: int | None = None,
                    history_maxlen: int = 20_000) -> None:
    """Every sample's key and history entry, the GPUs in the GPU set, then each node's health record (after its
    samples, with the same expiry: a reader that finds a GPU in it finds its sample). `client`: Redis or a pipeline;
    `ttl_ms` None: no expiry (tools and tests)."""
    if not samples:
        return
    c = cluster
    # One SADD of every GPU, not one per GPU: the set rarely changes, the command count matters.
    client.sadd(state.key(c, "gpus"), *(f"{s.node}:{s.gpu}" for s in samples))
    health: dict[str, NodeHealth] = {}
    for s in samples:
        data = state.encode(s)
        client.set(state.key(c, "telemetry", node=s.node, gpu=s.gpu), data, px=ttl_ms)
        client.xadd(state.key(c, "telemetry_history"), {"data": data}, maxlen=history_maxlen, approximate=True)
        h = health.get(s.node)
        if h is None:
            h = health[s.node] = NodeHealth(node=s.node, gpus=[])
        h.gpus.append(s.gpu)
        if s.error is not None:
            h.errors[s.gpu] = s.error
    for node, h in health.items():
        client.set(state.key(c, "gpu_health", node=node), state.encode(h), px=ttl_ms)
