"""GPU telemetry: NVML on real GPUs, a simulated stand-in elsewhere.

`NvmlTelemetry` reads utilization, memory, running processes and power through nvidia-ml-py; an error
on one device is reported in that device's sample (the GPU becomes UNKNOWN and is never lent) and
the others go on. `SimulatedTelemetry` is the only stand-in the project allows: for machines without
GPUs it derives utilization from the rollout workers' own reported activity and from the leases
(sessions) on each GPU, and every sample carries `simulated=True` so every display says so.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Protocol

from tailspec.core import state
from tailspec.core.state import GpuTelemetry, Lease, Progress, StateError

log = logging.getLogger(__name__)

GIB = 1 << 30


class TelemetryError(RuntimeError):
    """Telemetry cannot start (e.g. NVML is missing); the message says what to do instead."""


class Telemetry(Protocol):
    node: str
    simulated: bool

    def gpu_ids(self) -> list[int]: ...

    def sample(self) -> list[GpuTelemetry]: ...

    def close(self) -> None: ...


class NvmlTelemetry:
    simulated = False

    def __init__(self, node: str, nvml: Any = None):
        if nvml is None:
            try:
                # deferred: the NVML binding loads only where NVML telemetry is asked for (a GPU machine)
                import pynvml as nvml
            except ImportError as e:  # pragma: no cover - nvidia-ml-py is a core dependency
                raise TelemetryError(f"telemetry 'nvml' needs nvidia-ml-py: {e}") from None
        self.nvml = nvml
        self.node = node
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise TelemetryError(
                f"telemetry 'nvml': NVML failed to initialize ({e}); no NVIDIA driver / libnvidia-ml "
                "on this machine? Use scheduler.telemetry=simulated "
                "(or auto, which falls back with a warning)"
            ) from None
        try:
            self.count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            nvml.nvmlShutdown()
            raise TelemetryError(f"telemetry 'nvml': cannot count devices ({e})") from None
        self._handles: dict[int, Any] = {}

    def gpu_ids(self) -> list[int]:
        return list(range(self.count))

    def _handle(self, i: int) -> Any:
        h = self._handles.get(i)
        if h is None:
            h = self._handles[i] = self.nvml.nvmlDeviceGetHandleByIndex(i)
        return h

    def _pids(self, h: Any) -> list[int]:
        pids: set[int] = set()
        for fn_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(self.nvml, fn_name, None)
            if fn is None:
                continue
            try:
                pids.update(int(p.pid) for p in fn(h))
            except self.nvml.NVMLError:
                pass  # not supported on some devices / drivers: processes stay unknown, not an error
        return sorted(pids)

    def sample_one(self, i: int) -> GpuTelemetry:
        nvml = self.nvml
        now = time.time()
        try:
            h = self._handle(i)
            util = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            try:
                power = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            except nvml.NVMLError:
                power = None
            return GpuTelemetry(
                node=self.node,
                gpu=i,
                util=min(100.0, max(0.0, util)),
                mem_used=int(mem.used),
                mem_total=int(mem.total),
                power_w=power,
                processes=self._pids(h),
                simulated=False,
                ts=now,
            )
        except nvml.NVMLError as e:
            self._handles.pop(i, None)  # re-acquire next time: the device may come back
            return GpuTelemetry(
                node=self.node,
                gpu=i,
                util=0.0,
                mem_used=0,
                mem_total=0,
                simulated=False,
                error=f"NVML: {e}",
                ts=now,
            )

    def sample(self) -> list[GpuTelemetry]:
        return [self.sample_one(i) for i in range(self.count)]

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


class SimulatedTelemetry:
    """Utilization derived from what the cluster reports about itself (labelled simulated everywhere):
    a GPU whose worker has active requests is busy in proportion to its batch, a GPU with a lease is
    running a session, any other GPU idles near 0%."""

    simulated = True
    MEM_TOTAL = 80 * GIB

    def __init__(self, node: str, r: Any, cluster: str, num_gpus: int = 4, seed: int | None = None,
                 mem_total: int = MEM_TOTAL, shared_device: SharedDevice | None = None):
        self.node, self.r, self.cluster, self.num_gpus = node, r, cluster, num_gpus
        self.mem_total = int(mem_total)
        self.rng = random.Random(seed)
        self.bad_progress = 0
        self.shared_device = shared_device  # the real device the simulated GPUs are shares of, if any

    def worker_mem(self, p: Progress | None) -> int:
        """What a simulated GPU's rollout worker holds, in proportion to the GPU's size (of 80 GiB: 30 GiB of
        weights and KV cache, 0.25 GiB more per active request; 1 GiB once it finished and reported its memory
        released, as a sleeping vLLM keeps)."""
        if p is None:
            return 0
        if p.active == 0 and p.mem_released:
            return self.mem_total // 80
        return self.mem_total * 3 // 8 + min(p.active, 64) * self.mem_total // 320

    def free_for_session(self, gpu: int) -> int:
        """Bytes free on simulated GPU `gpu` for a session, sessions' own share left out (the check a session
        makes before loading, where NVML is not there to ask)."""
        owners, _ = self._activity()
        return max(0, self.mem_total - self.worker_mem(owners.get(gpu)))

    def gpu_ids(self) -> list[int]:
        return list(range(self.num_gpus))

    def _activity(self) -> tuple[dict[int, Progress], set[int]]:
        owners, leased = _read_activity(self.r, self.cluster, {self.node: self.num_gpus}, self)
        return ({g: p for (n, g), p in owners.items()}, {g for n, g in leased})

    def sample(self) -> list[GpuTelemetry]:
        owners, leased = self._activity()
        now = time.time()
        samples = [self._sample_gpu(self.node, g, owners.get(g), g in leased, now) for g in range(self.num_gpus)]
        if self.shared_device is not None:
            reading = self.shared_device.read()
            samples = [t.model_copy(update=reading) for t in samples]
        return samples

    def _sample_gpu(self, node: str, g: int, p: Progress | None, leased: bool, now: float) -> GpuTelemetry:
        mem = self.worker_mem(p)
        if p is not None and p.active > 0:
            util = 70.0 + 25.0 * min(1.0, p.active / 8) + self.rng.uniform(-3, 3)
        elif leased:
            util = 55.0 + self.rng.uniform(-5, 5)
            mem += self.mem_total // 10  # a session's teacher, drafter and optimizer
        else:
            util = self.rng.uniform(0.0, 2.0)
        util = min(100.0, max(0.0, util))
        return GpuTelemetry(
            node=node,
            gpu=g,
            util=round(util, 1),
            mem_used=min(mem, self.mem_total),
            mem_total=self.mem_total,
            power_w=round(70 + 6 * util, 1),
            processes=[],
            simulated=True,
            ts=now,
        )

    def close(self) -> None:
        if self.shared_device is not None:
            self.shared_device.close()


class SharedDevice:
    """One real CUDA device that several simulated GPUs are shares of (`tailspec demo --device cuda`): NVML reads
    the whole device, so its readings go into every share's sample beside the share's simulated utilisation
    (which the idle detector reads: NVML cannot tell the shares of one device apart), labelled with the device
    and how it is shared. A reading that fails leaves the fields None and the samples simulated as before."""

    def __init__(self, index: int, sharing: str, nvml: Any = None):
        self.index, self.sharing = index, sharing
        try:
            self.nvml: NvmlTelemetry | None = NvmlTelemetry("shared", nvml=nvml)
        except TelemetryError as e:
            log.warning("the shared device's NVML readings are off: %s", e)
            self.nvml = None

    def read(self) -> dict:
        label = f"cuda:{self.index}" + (f", {self.sharing}" if self.sharing else "")
        if self.nvml is None or self.index >= self.nvml.count:
            return {"device": label}
        t = self.nvml.sample_one(self.index)
        if t.error:
            return {"device": f"{label} ({t.error})"}
        return {"device": label, "device_util": t.util, "device_mem_used": t.mem_used, "device_mem_total": t.mem_total}

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()


class SimulatedNodes(SimulatedTelemetry):
    """Simulated telemetry of many nodes sampled by one process: what the per-node monitors of a large cluster
    publish, for benchmarks that stand in for one (`tailspec bench scheduler --gpus 1024`). The same model as
    SimulatedTelemetry, labelled simulated the same way; one read of the workers' progress and the leases per
    sample serves every node. `nodes`: node name → GPU count."""

    def __init__(self, r: Any, cluster: str, nodes: dict[str, int], seed: int | None = None,
                 mem_total: int = SimulatedTelemetry.MEM_TOTAL):
        if not nodes:
            raise ValueError("SimulatedNodes needs at least one node")
        first = next(iter(nodes))
        super().__init__(first, r, cluster, nodes[first], seed=seed, mem_total=mem_total)
        self.nodes = dict(nodes)  # `node`, `num_gpus` and the inherited per-GPU calls: the first node's

    def sample(self) -> list[GpuTelemetry]:
        owners, leased = _read_activity(self.r, self.cluster, self.nodes, self)
        now = time.time()
        return [self._sample_gpu(n, g, owners.get((n, g)), (n, g) in leased, now)
                for n, count in self.nodes.items() for g in range(count)]


def _read_activity(r: Any, cluster: str, nodes: dict[str, int], counter: Any
                   ) -> tuple[dict[tuple[str, int], Progress], set[tuple[str, int]]]:
    """Who is active where: (node, gpu) → the progress of the worker owning it (on `nodes` only), and the
    (node, gpu) pairs holding a lease. Two round trips: the worker set, then one MGET of every progress and lease
    key (one command, not one GET each: at a thousand GPUs the per-command cost of the client dominates).
    Progress that does not decode is counted on `counter.bad_progress` and skipped."""
    c = cluster
    workers = sorted(w.decode() if isinstance(w, bytes) else w for w in r.smembers(state.key(c, "workers")))
    gpus = [(n, g) for n, count in nodes.items() for g in range(count)]
    keys = [state.key(c, "progress", worker=w) for w in workers]
    keys += [state.key(c, "lease", node=n, gpu=g) for n, g in gpus]
    raw = r.mget(keys) if keys else []
    owners: dict[tuple[str, int], Progress] = {}
    for w, v in zip(workers, raw[: len(workers)]):
        if v is None:
            continue
        try:
            p = state.decode(Progress, v, where=f"progress:{w}")
        except StateError:
            counter.bad_progress += 1
            continue
        if p.node in nodes:
            for g in p.gpus:
                owners[(p.node, g)] = p
    leased = set()
    for k, v in zip(gpus, raw[len(workers):]):
        if v is not None:
            try:
                state.decode(Lease, v)
                leased.add(k)
            except StateError:
                pass
    return owners, leased


def make_telemetry(
    kind: str, node: str, r: Any, cluster: str, num_gpus: int = 4, nvml: Any = None,
    simulated_mem: int = SimulatedTelemetry.MEM_TOTAL, shared_device: SharedDevice | None = None,
) -> tuple[Telemetry, str | None]:
    """Build the configured telemetry. Returns (telemetry, warning): `auto` falls back to simulated
    with a warning when NVML does not initialize or sees no device; `nvml` raises TelemetryError.
    `shared_device`: simulated GPUs that are shares of that real device carry its NVML readings."""
    if kind not in ("auto", "nvml", "simulated"):
        raise TelemetryError(f"scheduler.telemetry must be auto, nvml or simulated, got {kind!r}")
    if kind == "simulated":
        return SimulatedTelemetry(node, r, cluster, num_gpus, mem_total=simulated_mem, shared_device=shared_device), None
    try:
        t = NvmlTelemetry(node, nvml=nvml)
    except TelemetryError as e:
        if kind == "nvml":
            raise
        msg = f"NVML unavailable ({e}); using SIMULATED GPU telemetry on node {node}"
        log.warning(msg)
        return SimulatedTelemetry(node, r, cluster, num_gpus, mem_total=simulated_mem), msg
    if t.count == 0 and kind == "auto":
        t.close()
        msg = f"NVML sees no GPU on node {node}; using SIMULATED GPU telemetry"
        log.warning(msg)
        return SimulatedTelemetry(node, r, cluster, num_gpus, mem_total=simulated_mem), msg
    return t, None


def free_memory(r: Any, cluster: str, node: str, gpu: int, simulated_mem: int = SimulatedTelemetry.MEM_TOTAL,
                nvml: Any = None) -> tuple[int | None, str]:
    """Bytes free on one GPU right now and where the figure came from, without creating a CUDA context (a
    session asks this before it loads anything). A GPU whose telemetry is simulated answers from the simulation
    (the configured size less what its rollout worker holds); a real one from NVML. (None, why) when neither
    can say: the caller decides without the check."""
    try:
        t = state.get(r, state.key(cluster, "telemetry", node=node, gpu=gpu), GpuTelemetry)
    except (StateError, Exception) as e:  # noqa: BLE001 - Redis down: fall through to NVML
        t, why = None, f"telemetry unreadable: {e}"
    else:
        why = "no telemetry for this GPU"
    if t is not None and t.simulated:
        sim = SimulatedTelemetry(node, r, cluster, num_gpus=gpu + 1, mem_total=simulated_mem)
        return sim.free_for_session(gpu), "simulated"
    try:
        if nvml is None:
            # deferred: the NVML binding loads only where NVML telemetry is asked for (a GPU machine)
            import pynvml as nvml
        nvml.nvmlInit()
        try:
            return int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(gpu)).free), "nvml"
        finally:
            nvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - no driver, no device: unknown, not an error of the session
        return None, f"{why}; NVML: {e}"
