"""Prometheus exporter: a collector that reads the cluster state on every scrape.

Nothing is cached between scrapes, so the exporter holds no state of its own and any number of them
can run. Names follow Prometheus conventions: `tailspec_` prefix, base units (seconds, bytes, ratio
0-1), `_total` for counters; per-GPU series carry `node`, `gpu`, `worker` labels, and telemetry
series a `simulated` label ("true" where no NVML is behind the numbers).

METRICS below lists every family with its type and help text; the Grafana dashboard may query only
these (tests/test_dashboards_grafana.py checks it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from tailspec.core.state import GpuState

from .snapshot import SessionCache, read_state

log = logging.getLogger(__name__)

GPU_LABELS = ["node", "gpu", "worker"]
STOP_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

# name → (type, help). Counter names are given without `_total` (prometheus-client appends it).
METRICS: dict[str, tuple[str, str]] = {
    "tailspec_redis_up": ("gauge", "1 when the cluster state (Redis) could be read on this scrape"),
    "tailspec_exporter_bad_payloads": ("counter", "malformed cluster-state entries skipped by this exporter"),
    "tailspec_phase": ("gauge", "1 for the current RL phase (idle / rollout / train)"),
    "tailspec_rl_step": ("gauge", "current RL step"),
    "tailspec_policy_version": ("gauge", "current policy version"),
    "tailspec_scheduler_heartbeat_age_seconds": ("gauge", "seconds since the scheduler's last loop"),
    "tailspec_gpu_utilization_ratio": ("gauge", "GPU utilization, 0-1 (simulated=\"true\": no NVML behind it)"),
    "tailspec_gpu_memory_used_bytes": ("gauge", "GPU memory used"),
    "tailspec_gpu_memory_total_bytes": ("gauge", "GPU memory total"),
    "tailspec_gpu_power_watts": ("gauge", "GPU power draw"),
    "tailspec_gpu_telemetry_error": ("gauge", "1 when the GPU's last telemetry read failed"),
    "tailspec_gpu_state": ("gauge", "1 for the GPU's current scheduler state, 0 for the others"),
    "tailspec_gpus": ("gauge", "number of GPUs in each scheduler state"),
    "tailspec_idle_gpu_seconds": ("counter", "GPU-seconds the long tail left idle during rollout"),
    "tailspec_lent_gpu_seconds": ("counter", "GPU-seconds lent to drafter training (reclaimed from the tail)"),
    "tailspec_reclaimed_share_ratio": ("gauge", "lent / idle GPU-seconds, 0-1"),
    "tailspec_sessions_started": ("counter", "drafter training sessions started"),
    "tailspec_sessions_stopped": ("counter", "drafter training sessions stopped"),
    "tailspec_sessions_preempted": ("counter", "sessions stopped because the GPU was reclaimed"),
    "tailspec_sessions_declined": ("counter", "sessions that declined a lent GPU: its free memory could not hold "
                                   "teacher + drafter + optimizer"),
    "tailspec_drafter_guard_trips": ("counter", "drafter health guard trips on the rollout workers (live acceptance "
                                     "below the floor after a drafter load or a policy-weight sync)"),
    "tailspec_drafter_guard_speculation_off": ("gauge", "rollout workers whose latest drafter health-guard "
                                               "verdict tripped: decoding without speculation there"),
    "tailspec_sessions": ("gauge", "session records by status"),
    "tailspec_session_stop_latency_seconds": ("histogram", "revocation → session stopped and GPU freed"),
    "tailspec_drafter_training_loss": ("gauge", "training loss of the latest session on each GPU"),
    "tailspec_drafter_training_steps": ("gauge", "optimizer steps of the latest session on each GPU"),
    "tailspec_drafter_version": ("gauge", "promoted drafter version the workers load"),
    "tailspec_drafter_acceptance_length": ("gauge", "validation acceptance length of the promoted drafter"),
    "tailspec_drafter_baseline_acceptance_length": (
        "gauge", "validation acceptance length of the version it replaced, on the same samples"),
    "tailspec_drafter_candidates": ("gauge", "drafter candidates by promotion outcome"),
    "tailspec_drafter_live_acceptance_length": (
        "gauge", "current drafter's acceptance length on the newest samples with the current policy (staleness)"),
    "tailspec_drafter_promoted_acceptance_length": (
        "gauge", "the same drafter's validated acceptance length when it was promoted"),
    "tailspec_drafter_promotion_gain_lcb": (
        "gauge", "lower confidence bound of the paired gain of the latest candidate over the current version"),
    "tailspec_lineage_steps": ("gauge", "optimizer steps merged into the drafter lineage, all sessions"),
    "tailspec_lineage_merges": ("gauge", "merges into the drafter lineage"),
    "tailspec_samples_stream_length": ("gauge", "entries in the sample stream"),
    "tailspec_samples_policy_version": ("gauge", "policy version at each end of the sample stream"),
    "tailspec_rollout_step": ("gauge", "RL step of each worker's latest rollout figures"),
    "tailspec_rollout_acceptance_length": ("gauge", "mean acceptance length (tokens per target forward) of the latest phase"),
    "tailspec_rollout_tokens_per_second": ("gauge", "generated tokens per second of the latest phase"),
    "tailspec_rollout_speedup_ratio": ("gauge", "tokens/s over plain decoding's tokens/s (when the worker measured it)"),
    "tailspec_rollout_strategy_share_ratio": ("gauge", "share of decode steps that used strategy k (a chain by its draft length, a tree by its label), latest phase"),
    "tailspec_dropped_samples": ("counter", "dropped samples and client messages by reason"),
}


def exposed_names() -> set[str]:
    """Every sample name /metrics can carry (counters with `_total`, histograms with their suffixes)."""
    out = set()
    for name, (kind, _) in METRICS.items():
        if kind == "counter":
            out |= {name + "_total", name + "_created"}
        elif kind == "histogram":
            out |= {name + "_bucket", name + "_sum", name + "_count"}
        else:
            out.add(name)
    return out


def _family(name: str, labels: list[str] | None = None) -> Any:
    kind, doc = METRICS[name]
    cls = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}[kind]
    return cls(name, doc, labels=labels)


def _gauge(name: str, value: float) -> Any:
    """A label-free family with one sample."""
    f = _family(name)
    f.add_metric([], value)
    return f


def _histogram(values: Iterable[float], buckets=STOP_LATENCY_BUCKETS) -> tuple[list[tuple[str, float]], float]:
    vals = sorted(values)
    out, i = [], 0
    for b in buckets:
        while i < len(vals) and vals[i] <= b:
            i += 1
        out.append((repr(float(b)), float(i)))
    out.append(("+Inf", float(len(vals))))
    return out, float(sum(vals))


class StateCollector(Collector):
    """Reads the cluster state on each scrape and yields every family in METRICS."""

    def __init__(self, redis_client: Any, cluster: str):
        self.r = redis_client
        self.cluster = cluster
        self._bad_total = 0
        self._lock = threading.Lock()
        self._ended_sessions = SessionCache()  # ended sessions' records, read once

    def describe(self) -> list[Metric]:
        return []  # registering must not touch Redis

    def collect(self) -> Iterable[Metric]:
        up = _family("tailspec_redis_up")
        try:
            view, sessions = read_state(self.r, self.cluster, sessions_limit=None, cache=self._ended_sessions)
        except Exception as e:  # noqa: BLE001 — Redis down or unreadable: report it, never fail the scrape
            log.warning("cluster state unreadable: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        with self._lock:
            self._bad_total += view.bad_payloads
            bad = _family("tailspec_exporter_bad_payloads")
            bad.add_metric([], self._bad_total)
        yield bad
        yield from self._phase(view)
        yield from self._gpus(view)
        yield from self._counters(view)
        yield from self._sessions(view, sessions)
        yield from self._drafter(view)
        yield from self._rollout(view)
        dropped = _family("tailspec_dropped_samples", ["reason"])
        for reason, n in view.dropped.items():
            dropped.add_metric([reason], n)
        yield dropped

    def _phase(self, view) -> Iterable[Metric]:
        phase = _family("tailspec_phase", ["phase"])
        current = view.phase.phase if view.phase else None
        for p in ("idle", "rollout", "train"):
            phase.add_metric([p], 1.0 if p == current else 0.0)
        yield phase
        if view.phase:
            step, pv = _family("tailspec_rl_step"), _family("tailspec_policy_version")
            step.add_metric([], view.phase.step)
            pv.add_metric([], view.phase.policy_version)
            yield step
            yield pv
        if view.scheduler_heartbeat_age_s is not None:
            hb = _family("tailspec_scheduler_heartbeat_age_seconds")
            hb.add_metric([], view.scheduler_heartbeat_age_s)
            yield hb

    def _gpus(self, view) -> Iterable[Metric]:
        tel_labels = GPU_LABELS + ["simulated"]
        util = _family("tailspec_gpu_utilization_ratio", tel_labels)
        used = _family("tailspec_gpu_memory_used_bytes", tel_labels)
        total = _family("tailspec_gpu_memory_total_bytes", tel_labels)
        power = _family("tailspec_gpu_power_watts", tel_labels)
        err = _family("tailspec_gpu_telemetry_error", tel_labels)
        st = _family("tailspec_gpu_state", GPU_LABELS + ["state"])
        count = _family("tailspec_gpus", ["state"])
        per_state = {s.value: 0 for s in GpuState}
        for g in view.gpus:
            base = [g.node, str(g.gpu), g.worker or ""]
            if g.simulated is not None:
                tl = base + ["true" if g.simulated else "false"]
                util.add_metric(tl, (g.util or 0.0) / 100.0)
                used.add_metric(tl, g.mem_used or 0)
                total.add_metric(tl, g.mem_total or 0)
                if g.power_w is not None:
                    power.add_metric(tl, g.power_w)
                err.add_metric(tl, 1.0 if g.error else 0.0)
            for s in GpuState:
                st.add_metric(base + [s.value], 1.0 if g.state == s else 0.0)
            per_state[g.state.value] += 1
        for s, n in per_state.items():
            count.add_metric([s], n)
        yield from (util, used, total, power, err, st, count)

    def _counters(self, view) -> Iterable[Metric]:
        c = view.counters
        for name, value in [
            ("tailspec_idle_gpu_seconds", c.idle_gpu_seconds), ("tailspec_lent_gpu_seconds", c.lent_gpu_seconds),
            ("tailspec_sessions_started", c.sessions_started), ("tailspec_sessions_stopped", c.sessions_stopped),
            ("tailspec_sessions_preempted", c.sessions_preempted), ("tailspec_sessions_declined", c.sessions_declined),
            ("tailspec_drafter_guard_trips", c.drafter_guard_trips),
        ]:
            m = _family(name)
            m.add_metric([], value)
            yield m
        share = _family("tailspec_reclaimed_share_ratio")
        share.add_metric([], c.reclaimed_share or 0.0)
        yield share
        off = _family("tailspec_drafter_guard_speculation_off")
        off.add_metric([], sum(g.tripped for g in view.drafter_guard))
        yield off

    def _sessions(self, view, sessions) -> Iterable[Metric]:
        by_status = _family("tailspec_sessions", ["status"])
        counts: dict[str, int] = {s: 0 for s in ("starting", "running", "stopping", "stopped", "failed")}
        for s in sessions:
            counts[s.status] += 1
        for s, n in counts.items():
            by_status.add_metric([s], n)
        yield by_status
        buckets, total = _histogram(s.stop_latency_s for s in sessions if s.stop_latency_s is not None)
        hist = HistogramMetricFamily("tailspec_session_stop_latency_seconds",
                                     METRICS["tailspec_session_stop_latency_seconds"][1])
        hist.add_metric([], buckets, total)
        yield hist
        # Latest session per GPU (sessions are newest first): bounded cardinality, one series per GPU.
        loss = _family("tailspec_drafter_training_loss", GPU_LABELS)
        steps = _family("tailspec_drafter_training_steps", GPU_LABELS)
        workers = {(g.node, g.gpu): g.worker or "" for g in view.gpus}
        seen = set()
        for s in sessions:
            if (s.node, s.gpu) in seen:
                continue
            seen.add((s.node, s.gpu))
            labels = [s.node, str(s.gpu), workers.get((s.node, s.gpu), "")]
            steps.add_metric(labels, s.step)
            if s.loss is not None:
                loss.add_metric(labels, s.loss)
        yield loss
        yield steps

    def _drafter(self, view) -> Iterable[Metric]:
        cur = view.drafter_current
        if cur is not None:
            yield _gauge("tailspec_drafter_version", cur.version)
            if cur.acceptance_length is not None:
                yield _gauge("tailspec_drafter_acceptance_length", cur.acceptance_length)
            if cur.baseline_acceptance_length is not None:
                yield _gauge("tailspec_drafter_baseline_acceptance_length", cur.baseline_acceptance_length)
        cands = _family("tailspec_drafter_candidates", ["promoted"])
        promoted = sum(1 for v in view.drafter_versions if v.promoted)
        cands.add_metric(["true"], promoted)
        cands.add_metric(["false"], len(view.drafter_versions) - promoted)
        yield cands
        scored = [v for v in view.drafter_versions if v.gain_lcb is not None]
        if scored:
            yield _gauge("tailspec_drafter_promotion_gain_lcb", scored[-1].gain_lcb)
        if view.drafter_health:
            h = view.drafter_health[-1]
            yield _gauge("tailspec_drafter_live_acceptance_length", h.acceptance_length)
            if h.at_promotion is not None:
                yield _gauge("tailspec_drafter_promoted_acceptance_length", h.at_promotion)
        if view.lineage is not None:
            yield _gauge("tailspec_lineage_steps", view.lineage.steps)
            yield _gauge("tailspec_lineage_merges", view.lineage.merges)
        if view.samples is not None:
            yield _gauge("tailspec_samples_stream_length", view.samples.length)
            ends = _family("tailspec_samples_policy_version", ["end"])
            for end, v in (("oldest", view.samples.oldest_policy_version), ("newest", view.samples.newest_policy_version)):
                if v is not None:
                    ends.add_metric([end], v)
            yield ends

    def _rollout(self, view) -> Iterable[Metric]:
        latest = {}
        for p in view.rollout:  # oldest first: the last one per worker wins
            latest[p.worker] = p
        step = _family("tailspec_rollout_step", ["worker"])
        acc = _family("tailspec_rollout_acceptance_length", ["worker"])
        tps = _family("tailspec_rollout_tokens_per_second", ["worker"])
        speed = _family("tailspec_rollout_speedup_ratio", ["worker"])
        mix = _family("tailspec_rollout_strategy_share_ratio", ["worker", "k"])
        for w, p in sorted(latest.items()):
            step.add_metric([w], p.step)
            acc.add_metric([w], p.acceptance_length)
            if p.tokens_per_s is not None:
                tps.add_metric([w], p.tokens_per_s)
            if p.speedup is not None:
                speed.add_metric([w], p.speedup)
            n = sum(p.strategy_mix.values())
            for k, steps in sorted(p.strategy_mix.items()):
                mix.add_metric([w, k], steps / n if n else 0.0)
        yield from (step, acc, tps, speed, mix)


def make_registry(redis_client: Any, cluster: str) -> CollectorRegistry:
    """A registry holding only the cluster-state collector (no process/platform collectors: the
    exporter's own process is not what users watch)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StateCollector(redis_client, cluster))
    return reg
