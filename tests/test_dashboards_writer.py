"""A state writer for the dashboards' tests: writes realistic cluster state into a real redis-server
through tailspec.core.state's helpers, the way the scheduler, the trainer and the rollout workers do,
and plays a GPU through generating → drained → lent → generating with counters growing.

The other tests/test_dashboards_*.py import StateWriter from here; the tests in this file check the
writer's own bookkeeping against what the dashboards' reader sees."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tailspec.core import state as S
from tailspec.core.state import (
    DrafterHealth,
    DrafterVersion,
    Event,
    GpuState,
    GpuStatus,
    GpuTelemetry,
    LineageHead,
    PhaseInfo,
    RolloutStats,
    Sample,
    SessionInfo,
)

GiB = 2**30


@dataclass
class StateWriter:
    r: object
    cluster: str = "t"
    node: str = "node0"
    n_gpus: int = 2
    simulated: bool = True
    mem_total: int = 80 * GiB
    sessions: dict[str, SessionInfo] = field(default_factory=dict)
    token: int = 0

    def k(self, name: str, **f) -> str:
        return S.key(self.cluster, name, **f)

    def telemetry(self, gpu: int, util: float, mem_used: int, ts: float | None = None, error: str | None = None,
                  node: str | None = None) -> GpuTelemetry:
        node = node or self.node
        t = GpuTelemetry(node=node, gpu=gpu, util=util, mem_used=mem_used, mem_total=self.mem_total,
                         power_w=80 + 3 * util, simulated=self.simulated, error=error, ts=ts or time.time())
        S.put(self.r, self.k("telemetry", node=node, gpu=gpu), t)
        S.append(self.r, self.k("telemetry_history"), t)
        self.r.sadd(self.k("gpus"), f"{node}:{gpu}")
        return t

    def status(self, gpu: int, st: GpuState, since: float | None = None, worker: str | None = "w0",
               session_id: str | None = None, lease_token: int | None = None, node: str | None = None) -> GpuStatus:
        node = node or self.node
        s = GpuStatus(node=node, gpu=gpu, state=st, since=since or time.time(), worker=worker,
                      session_id=session_id, lease_token=lease_token)
        S.put(self.r, self.k("gpu_status", node=node, gpu=gpu), s)
        S.append(self.r, self.k("status_history"), s)
        return s

    def add(self, counter: str, value: float) -> None:
        self.r.hincrbyfloat(self.k("counters"), counter, value)

    def phase(self, phase: str, step: int, policy_version: int = 0) -> None:
        S.put(self.r, self.k("phase"), PhaseInfo(phase=phase, step=step, started_at=time.time(),
                                                  policy_version=policy_version))

    def heartbeat(self) -> None:
        self.r.set(self.k("scheduler_heartbeat"), repr(time.time()), px=10_000)

    def event(self, kind: str, gpu: int | None = None, **detail) -> None:
        S.append(self.r, self.k("events"), Event(kind=kind, node=self.node if gpu is not None else None,
                                                 gpu=gpu, detail=detail))

    def session(self, session_id: str, gpu: int, **fields) -> SessionInfo:
        prev = self.sessions.get(session_id)
        base = prev.model_dump() if prev else {
            "session_id": session_id, "node": self.node, "gpu": gpu, "lease_token": self.token or 1,
            "status": "starting", "started_at": time.time()}
        s = SessionInfo.model_validate({**base, **fields})
        self.sessions[session_id] = s
        S.put(self.r, self.k("session", session_id=session_id), s)
        self.r.sadd(self.k("sessions"), session_id)
        return s

    def version(self, version: int, acceptance: float, baseline: float | None, promoted: bool) -> DrafterVersion:
        scored = {} if baseline is None else dict(
            baseline_version=version - 1, pairs=32, gain_mean=acceptance - baseline,
            gain_lcb=acceptance - baseline - 0.1, decision="paired gain (test writer)")
        v = DrafterVersion(version=version, path=f"runs/drafter/v{version}", policy_version=version,
                           acceptance_length=acceptance, baseline_acceptance_length=baseline,
                           promoted=promoted, created_at=time.time(), **scored)
        self.r.rpush(self.k("drafter_versions"), S.encode(v))
        if promoted:
            S.put(self.r, self.k("drafter_current"), v)
        return v

    def rollout(self, worker: str, step: int, tokens: int, seconds: float, forwards: int,
                mix: dict[str, int], baseline_tps: float | None = None, drafter_version: int | None = None):
        s = RolloutStats(worker=worker, step=step, tokens=tokens, seconds=seconds, target_forwards=forwards,
                         drafted=sum(int(k) * n for k, n in mix.items()), accepted=tokens - forwards,
                         acceptance_length=tokens / forwards, strategy_mix=mix, drafter_version=drafter_version,
                         baseline_tokens_per_s=baseline_tps, ts=time.time())
        S.append(self.r, self.k("rollout_stats"), s)
        return s

    def drop(self, reason: str, n: int = 1) -> None:
        self.r.hincrby(self.k("dropped"), reason, n)

    # ---- a GPU's lending cycle, as the scheduler and a session write it --------------------------

    def cycle(self, gpu: int, stage: str, session_id: str = "s1", dt: float = 1.0) -> None:
        """One stage of generating → drained → lent → reclaiming → generating. Counters grow the way
        the scheduler's do: idle time accrues while drained or lent, lent time while lent."""
        if stage == "generating":
            self.telemetry(gpu, 95.0, 60 * GiB)
            self.status(gpu, GpuState.GENERATING)
        elif stage == "drained":
            self.telemetry(gpu, 2.0, 60 * GiB)
            self.status(gpu, GpuState.DRAINED)
            self.add("idle_gpu_seconds", dt)
            self.event("gpu_idle", gpu)
        elif stage == "lent":
            self.token += 1
            self.telemetry(gpu, 70.0, 70 * GiB)
            self.status(gpu, GpuState.LENT, session_id=session_id, lease_token=self.token)
            self.add("idle_gpu_seconds", dt)
            self.add("lent_gpu_seconds", dt)
            self.add("sessions_started", 1)
            self.session(session_id, gpu, lease_token=self.token, status="running", step=5, loss=2.5, tokens=4096)
            self.event("lease_granted", gpu, token=self.token)
        elif stage == "train":  # stays lent, session makes progress
            self.add("idle_gpu_seconds", dt)
            self.add("lent_gpu_seconds", dt)
            s = self.sessions[session_id]
            self.session(session_id, gpu, step=s.step + 10, loss=(s.loss or 3.0) * 0.8, tokens=s.tokens + 8192)
        elif stage == "reclaiming":
            self.status(gpu, GpuState.RECLAIMING, session_id=session_id, lease_token=self.token)
            self.event("lease_revoked", gpu, reason="worker generating")
        elif stage == "reclaimed":
            self.telemetry(gpu, 95.0, 60 * GiB)
            self.status(gpu, GpuState.GENERATING)
            self.add("sessions_stopped", 1)
            self.add("sessions_preempted", 1)
            self.session(session_id, gpu, status="stopped", stopped_at=time.time(), stop_reason="revoked",
                         stop_latency_s=0.12)
            self.event("session_stopped", gpu, session_id=session_id)
        else:
            raise ValueError(stage)

    def populate(self) -> None:
        """Every figure the dashboards show, so /metrics carries every family (Grafana test, page)."""
        self.phase("rollout", step=3, policy_version=3)
        self.heartbeat()
        for g in range(self.n_gpus):
            self.cycle(g, "generating")
        self.cycle(0, "drained")
        self.cycle(0, "lent", session_id="s-old")
        self.cycle(0, "reclaiming", session_id="s-old")
        self.cycle(0, "reclaimed", session_id="s-old")
        self.cycle(0, "drained")
        self.cycle(0, "lent", session_id="s-new")
        for v, (acc, promoted) in enumerate([(1.8, True), (2.4, True), (2.2, False), (2.9, True)]):
            self.version(v, acc, None if v == 0 else 1.8, promoted)
        for step in range(1, 4):
            self.rollout("w0", step, tokens=20_000, seconds=10.0 / (1 + 0.1 * step), forwards=8000 - 500 * step,
                         mix={"0": 10, "2": 30, "4": 60}, baseline_tps=1500.0, drafter_version=step)
            self.rollout("w1", step, tokens=18_000, seconds=9.0, forwards=7000, mix={"0": 50, "4": 50},
                         baseline_tps=1500.0)
        self.drop("stale_policy", 3)
        self.drop("bad_sample", 1)
        S.put(self.r, self.k("lineage_head"), LineageHead(number=7, path="runs/drafter/lineage/head-00000007-s-1",
                                                          steps=120, merges=6, updated_at=time.time()))
        for step, (now, at) in enumerate([(2.9, 2.9), (2.7, 2.9), (2.5, 2.9)]):
            S.append(self.r, self.k("drafter_health"), DrafterHealth(
                drafter_version=3, policy_version=step, step=step, acceptance_length=now, at_promotion=at, samples=32))
        for v in (2, 3):
            S.append(self.r, self.k("samples"), Sample(prompt_ids=[1], response_ids=[2], reward=1.0, policy_version=v))


def test_writer_round_trip_through_reader(redis_client):
    from tailspec.dashboards.snapshot import read_state

    w = StateWriter(redis_client)
    w.populate()
    view, sessions = read_state(redis_client, "t")
    assert [g.id for g in view.gpus] == ["node0:0", "node0:1"]
    assert view.gpus[0].state == GpuState.LENT and view.gpus[0].session_id == "s-new"
    assert view.gpus[1].state == GpuState.GENERATING
    assert view.simulated and all(g.simulated for g in view.gpus)
    c = view.counters
    # independent bookkeeping: 2 drained stages (1 s each) + 2 lent stages (1 s each, idle and lent)
    assert (c.idle_gpu_seconds, c.lent_gpu_seconds) == (4.0, 2.0)
    assert c.reclaimed_share == 0.5
    assert (c.sessions_started, c.sessions_stopped, c.sessions_preempted) == (2, 1, 1)
    assert [s.session_id for s in sessions] == ["s-new", "s-old"]  # newest first
    assert view.drafter_current.version == 3 and len(view.drafter_versions) == 4
    assert view.dropped == {"bad_sample": 1, "stale_policy": 3}
    assert view.bad_payloads == 0
