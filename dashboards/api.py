"""The read-only JSON API's response models: `/api/state` → StateView, `/api/timeline` → TimelineView.

These pydantic models ARE the documented schema: `/api/schema` serves their JSON Schema, and the
tests validate live responses against it. Field units are base units (seconds, bytes, percent for
utilization as NVML reports it). `api_version` changes only when a field is removed or changes meaning.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from tailspec.core.state import (
    DrafterHealth,
    DrafterVersion,
    Event,
    GpuState,
    GuardStatus,
    LineageHead,
    PhaseInfo,
    SessionInfo,
)

API_VERSION = 1


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuView(_View):
    id: str = Field(description="'{node}:{gpu}'")
    node: str
    gpu: int
    state: GpuState = Field(description="scheduler's state; 'unknown' when the scheduler has not written one")
    state_since: float | None = Field(None, description="unix time the GPU entered `state`")
    worker: str | None = None
    session_id: str | None = Field(None, description="training session on the GPU while lent")
    lease_token: int | None = None
    util: float | None = Field(None, description="utilization, percent (0-100)")
    mem_used: int | None = Field(None, description="bytes")
    mem_total: int | None = Field(None, description="bytes")
    power_w: float | None = None
    simulated: bool | None = Field(None, description="telemetry is simulated (no NVML); None = no telemetry yet")
    telemetry_ts: float | None = None
    error: str | None = Field(None, description="telemetry error (e.g. NVML failure on this GPU)")
    device: str | None = Field(None, description="the real CUDA device a simulated GPU is a share of, and how it is "
                               "shared; None: not a share of one")
    device_util: float | None = Field(None, description="that whole device's utilization (NVML), percent")
    device_mem_used: int | None = Field(None, description="that whole device's memory in use (NVML), bytes")


class Counters(_View):
    idle_gpu_seconds: float = Field(0.0, description="GPU-seconds the long tail left idle during rollout")
    lent_gpu_seconds: float = Field(0.0, description="GPU-seconds lent to drafter training (reclaimed)")
    reclaimed_share: float | None = Field(None, description="lent / idle GPU-seconds, 0-1; None before any idle time")
    sessions_started: int = 0
    sessions_stopped: int = 0
    sessions_preempted: int = 0
    sessions_declined: int = Field(0, description="sessions that declined a lent GPU (teacher, drafter and optimizer "
                                   "would not fit its free memory): the GPU went back untouched")
    drafter_guard_trips: int = Field(0, description="times a rollout worker's drafter health guard tripped (live "
                                     "acceptance below the floor after a load or a weight sync): speculation off there")


class RolloutPoint(_View):
    worker: str
    step: int
    ts: float
    acceptance_length: float = Field(description="tokens emitted per target forward")
    tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    speedup: float | None = Field(None, description="tokens_per_s / baseline_tokens_per_s; None without a baseline")
    strategy_mix: dict[str, int] = Field(default_factory=dict, description="strategy (a chain by its k, a tree by its label) → decode steps")
    drafter_version: int | None = None


class SampleStreamView(_View):
    length: int = Field(description="entries in the sample stream (bounded: MAXLEN ~ and trimming by version)")
    oldest_policy_version: int | None = None
    newest_policy_version: int | None = None


class StateView(_View):
    api_version: Literal[1] = API_VERSION
    cluster: str
    now: float = Field(description="server's unix time when read")
    simulated: bool = Field(description="true when any GPU's telemetry is simulated")
    phase: PhaseInfo | None = None
    scheduler_heartbeat_age_s: float | None = Field(None, description="seconds since the scheduler's last loop")
    gpus: list[GpuView]
    counters: Counters
    sessions: list[SessionInfo] = Field(description="most recent first (at most `sessions_limit`)")
    sessions_total: int
    drafter_current: DrafterVersion | None = None
    drafter_versions: list[DrafterVersion] = Field(description="every candidate, oldest first (recent ones)")
    rollout: list[RolloutPoint] = Field(description="recent per-phase rollout figures, oldest first")
    dropped: dict[str, int] = Field(description="dropped samples / messages by reason")
    events: list[Event] = Field(description="recent events, newest first")
    lineage: LineageHead | None = Field(None, description="head of the drafter lineage sessions merge into")
    drafter_health: list[DrafterHealth] = Field(
        default_factory=list, description="current drafter's acceptance on the newest samples beside its value "
        "at promotion, oldest first (recent ones)")
    drafter_guard: list[GuardStatus] = Field(
        default_factory=list, description="each rollout worker's latest drafter health-guard verdict, by worker; "
        "a tripped one decodes without speculation until another version loads and is judged healthy")
    samples: SampleStreamView | None = None
    bad_payloads: int = Field(0, description="malformed state entries skipped while reading")


class Segment(_View):
    state: GpuState
    start: float
    end: float
    open: bool = Field(False, description="the GPU is still in this state at `end` (= now)")


class GpuLane(_View):
    id: str
    node: str
    gpu: int
    segments: list[Segment] = Field(description="consecutive, non-overlapping, oldest first, within the window; "
                                    "they start at the GPU's first recorded state (none: never recorded)")


class TelemetrySeries(_View):
    id: str
    node: str
    gpu: int
    simulated: bool
    ts: list[float]
    util: list[float] = Field(description="percent")
    mem_used: list[int] = Field(description="bytes")


class TimelineView(_View):
    api_version: Literal[1] = API_VERSION
    cluster: str
    now: float
    start: float = Field(description="window start (unix time)")
    window_s: float
    gpus: list[GpuLane]
    telemetry: list[TelemetrySeries]
    bad_payloads: int = 0


def json_schema() -> dict:
    """The documented schema of every endpoint's response, served at /api/schema."""
    return {
        "api_version": API_VERSION,
        "endpoints": {
            "/api/state": {"method": "GET", "query": {}, "response": StateView.model_json_schema()},
            "/api/timeline": {
                "method": "GET",
                "query": {"window": "seconds of history, number in [1, 86400], default 300"},
                "response": TimelineView.model_json_schema(),
            },
            "/metrics": {"method": "GET", "response": "Prometheus text exposition format"},
        },
    }
