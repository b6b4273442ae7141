"""A scripted long-tail rollout that drives the real scheduler through the real client and Redis.

N workers, each owning GPU i of one node, decode a batch of requests; a request of L tokens finishes
after L × token_time_s (continuous batching: every active request gains one token per decode step), so
a worker drains when its longest request is done. Lengths come from the caller (e.g. the task's length
distribution) or from a log-normal (median, sigma). Each rollout step is framed by set_phase("rollout")
and set_phase("train"); the script records the true drain times, so callers can compare the
scheduler's view (counters, events) with ground truth.

    from tailspec.scheduler.scripted_rollout import run_scripted_rollout
    result = run_scripted_rollout(redis_url, workers=4, steps=2, cluster="default")
    result.idle_gpu_seconds  # Σ over workers of (phase end − drain), the true idle GPU time

Only the GPUs are simulated (with SimulatedTelemetry, labelled so); Redis, the client, the scheduler
process and the sessions are real.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tailspec.core.config import TailspecConfig
from tailspec.scheduler.client import TailspecClient
from tailspec.scheduler.service import run_local


@dataclass
class ScriptedStep:
    step: int
    started_at: float
    ended_at: float = 0.0
    drained_at: dict[str, float] = field(default_factory=dict)  # worker → time its last request finished
    lengths: dict[str, list[int]] = field(default_factory=dict)

    gpus_per_worker: int = 1  # a drained worker leaves all its GPUs idle

    @property
    def idle_gpu_seconds(self) -> float:
        return self.gpus_per_worker * sum(max(0.0, self.ended_at - t) for t in self.drained_at.values())


@dataclass
class ScriptedResult:
    workers: int
    steps: list[ScriptedStep]
    node: str
    worker_gpus: dict[str, list[int]]  # worker → its GPU indices on its node
    worker_node: dict[str, str] = field(default_factory=dict)
    progress_reports: int = 0  # report_progress calls made
    report_seconds: float = 0.0  # wall time the rollouts took (the reports' span)

    @property
    def idle_gpu_seconds(self) -> float:
        return sum(s.idle_gpu_seconds for s in self.steps)  # GPU-seconds: × gpus_per_worker

    @property
    def rollout_seconds(self) -> float:
        return sum(s.ended_at - s.started_at for s in self.steps)


def lognormal_lengths(
    n: int,
    median: float = 45.0,
    sigma: float = 0.8,
    lo: int = 8,
    hi: int = 400,
    rng: random.Random | None = None,
) -> list[int]:
    rng = rng or random.Random(0)
    return [int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma)))))) for _ in range(n)]


def node_gpus(node: str, gpus: int, gpus_per_node: int | None = None) -> dict[str, int]:
    """The simulated cluster's nodes and their GPU counts: `gpus` GPUs on one node named `node`, or on nodes
    of `gpus_per_node` GPUs each named `{node}-{i}` (the last may hold fewer)."""
    if gpus_per_node is None or gpus_per_node >= gpus:
        return {node: gpus}
    n = -(-gpus // gpus_per_node)
    return {f"{node}-{i}": min(gpus_per_node, gpus - i * gpus_per_node) for i in range(n)}


def run_scripted_rollout(
    redis_url: str,
    workers: int = 4,
    steps: int = 2,
    *,
    gpus_per_worker: int = 1,
    gpus_per_node: int | None = None,
    policy_path: str | None = None,
    policy_version: int = 0,
    requests_per_worker: int = 8,
    lengths: Sequence[int] | None = None,
    token_time_s: float = 0.02,
    train_s: float = 0.5,
    cluster: str = "default",
    node: str = "node0",
    seed: int = 0,
    median_tokens: float = 45.0,
    sigma: float = 0.8,
    report_period_s: float = 0.005,
    client: TailspecClient | None = None,
    stop: threading.Event | None = None,
) -> ScriptedResult:
    """Run `steps` rollout steps with `workers` simulated workers (worker i on GPUs i·k … i·k + k − 1 of the
    cluster, k = `gpus_per_worker`, as a tensor-parallel replica; GPUs on one node, or `gpus_per_node` per node:
    see node_gpus); returns ground truth. `lengths` (tokens per request) are consumed in order, cycling;
    otherwise log-normal draws. `policy_path` / `policy_version` go into the phase record (what real sessions
    load their teacher from)."""
    _check_args(workers, steps, requests_per_worker, gpus_per_worker, gpus_per_node, token_time_s, lengths)
    own_client = client is None
    c = client or TailspecClient(redis_url, cluster=cluster, node=node)
    rng = random.Random(seed)
    fleet = _Fleet.place(c, workers, gpus_per_worker, gpus_per_node, node, requests_per_worker, token_time_s)
    draw = _length_source(lengths, median_tokens, sigma, rng)
    t_first = time.time()
    records: list[ScriptedStep] = []
    try:
        for step in range(1, steps + 1):
            if stop is not None and stop.is_set():
                break
            lens = {w: draw(requests_per_worker) for w in fleet.names}
            c.set_phase("rollout", step=step, policy_version=policy_version, policy_path=policy_path)
            rec = fleet.rollout(step, lens, gpus_per_worker, report_period_s, stop)
            c.set_phase("train", step=step, policy_version=policy_version, policy_path=policy_path)
            fleet.report_train(step)
            records.append(rec)
            if train_s > 0:
                time.sleep(train_s)
        c.set_phase("idle", step=len(records), policy_version=policy_version, policy_path=policy_path)
        c.flush(2.0)
    finally:
        if own_client:
            c.close()
    return ScriptedResult(workers=workers, steps=records, node=node, worker_gpus=fleet.gpus, worker_node=fleet.node,
                     progress_reports=fleet.reports, report_seconds=time.time() - t_first)


def _check_args(workers: int, steps: int, requests_per_worker: int, gpus_per_worker: int, gpus_per_node: int | None,
                token_time_s: float, lengths: Sequence[int] | None) -> None:
    if workers < 1 or steps < 1 or requests_per_worker < 1 or gpus_per_worker < 1:
        raise ValueError("workers, steps, requests_per_worker and gpus_per_worker must be ≥ 1")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus_per_node % gpus_per_worker):
        raise ValueError(f"gpus_per_node ({gpus_per_node}) must be a multiple of gpus_per_worker ({gpus_per_worker})")
    if token_time_s <= 0:
        raise ValueError(f"token_time_s must be > 0, got {token_time_s}")
    if lengths is not None and (len(lengths) == 0 or any(int(x) < 1 for x in lengths)):
        raise ValueError("lengths must be a non-empty sequence of positive token counts")


def _length_source(lengths: Sequence[int] | None, median_tokens: float, sigma: float,
                   rng: random.Random) -> Callable[[int], list[int]]:
    """n request lengths at a time: `lengths` in order, cycling, or log-normal draws."""
    cursor = 0

    def draw(n: int) -> list[int]:
        nonlocal cursor
        if lengths is None:
            return lognormal_lengths(n, median_tokens, sigma, rng=rng)
        out = [int(lengths[(cursor + i) % len(lengths)]) for i in range(n)]
        cursor += n
        return out

    return draw


@dataclass
class _Fleet:
    """The simulated workers: each one's GPUs and node, and how they report through the client."""

    c: TailspecClient
    names: list[str]
    gpus: dict[str, list[int]]
    node: dict[str, str]
    requests: int
    token_time_s: float
    reports: int = 0

    @classmethod
    def place(cls, c: TailspecClient, workers: int, gpus_per_worker: int, gpus_per_node: int | None, node: str,
              requests: int, token_time_s: float) -> _Fleet:
        names = [f"sim-worker{i}" for i in range(workers)]
        per_node = gpus_per_node if gpus_per_node is not None else workers * gpus_per_worker
        multi = per_node < workers * gpus_per_worker
        gpus = {w: [(i * gpus_per_worker + j) % per_node for j in range(gpus_per_worker)] for i, w in enumerate(names)}
        wnode = {w: f"{node}-{i * gpus_per_worker // per_node}" if multi else node for i, w in enumerate(names)}
        return cls(c, names, gpus, wnode, requests, token_time_s)

    def rollout(self, step: int, lens: dict[str, list[int]], gpus_per_worker: int, report_period_s: float,
                stop: threading.Event | None) -> ScriptedStep:
        """Decode every worker's requests in simulated time, reporting each change of its active count, until
        every worker drained (or `stop`)."""
        t0 = time.time()
        rec = ScriptedStep(step=step, started_at=t0, lengths=lens, gpus_per_worker=gpus_per_worker)
        last_active: dict[str, int] = {}
        while True:
            elapsed = time.time() - t0
            for w in self.names:
                active = sum(1 for L in lens[w] if L * self.token_time_s > elapsed)
                if active != last_active.get(w):
                    self._report_rollout(w, step, lens[w], active, elapsed)
                    last_active[w] = active
                    if active == 0:
                        rec.drained_at[w] = t0 + max(lens[w]) * self.token_time_s
            if len(rec.drained_at) == len(self.names) or (stop is not None and stop.is_set()):
                break
            time.sleep(report_period_s)
        rec.ended_at = time.time()
        return rec

    def _report_rollout(self, w: str, step: int, lens: list[int], active: int, elapsed: float) -> None:
        tt = self.token_time_s
        tokens = sum(min(L, int(elapsed / tt)) for L in lens if L * tt > elapsed)
        self.c.report_progress(w, self.gpus[w], active=active, finished=self.requests - active, phase="rollout",
                               total=self.requests, step=step, tokens_done=tokens, tokens_per_s=active / tt,
                               node=self.node[w])
        self.reports += 1

    def report_train(self, step: int) -> None:
        for w in self.names:
            self.c.report_progress(w, self.gpus[w], active=0, finished=self.requests, phase="train",
                                   total=self.requests, step=step, node=self.node[w])
            self.reports += 1


def run_scripted_cluster(
    redis_url: str,
    workers: int = 4,
    steps: int = 2,
    *,
    cluster: str = "default",
    node: str = "node0",
    session_entry: str = "tailspec.scheduler.busy_sessions:busy_session",
    settle_s: float = 1.5,
    **rollout_kw,
) -> ScriptedResult:
    """The whole single-node picture in one call: a scheduler (monitor + loop + session processes, simulated
    telemetry) in a background thread, driven by `run_scripted_rollout`; every key the dashboards read
    (telemetry + history, gpu_status + history, lease, session records, counters, events) gets filled.
    Returns the rollout's ground truth once the last revocations are done (after `settle_s`)."""
    cfg = TailspecConfig()
    cfg.cluster.name, cfg.cluster.node, cfg.cluster.redis_url = cluster, node, redis_url
    cfg.scheduler.telemetry = "simulated"
    cfg.scheduler.simulated_gpus = workers
    cfg.scheduler.session_entry = session_entry
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), name="tailspec-scheduler", daemon=True)
    th.start()
    try:
        result = run_scripted_rollout(redis_url, workers, steps, cluster=cluster, node=node, **rollout_kw)
        time.sleep(settle_s)
    finally:
        stop.set()
        th.join(15)
    return result
