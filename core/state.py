"""The cluster-state schema: every Redis key tailspec uses, its type, owner and payload, in one place.

Keys are namespaced `tailspec:{cluster}:…`. Payloads are JSON validated by pydantic models on both
encode and decode — never pickle, so nothing a peer writes can execute code in the reader. A bad
payload raises `StateError` naming the key and the field; long-running readers count and skip it.

Components import this module to agree on names; docs/architecture.md's import arrows allow `dashboards → state`, and scheduler / drafter_trainer / rollout use it the same way.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1

# Cluster and node names are parts of Redis keys and of '{node}:{gpu}' GPU ids (split at the last ':'), so they
# hold no ':' nor anything outside this set (ClusterConfig.name / node and the client check it).
NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_WORKER_GPUS = 1024  # GPUs one worker's progress may name: the scheduler keeps a state machine per GPU id


class StateError(ValueError):
    """A payload read from or written to the cluster state does not match its schema."""


class GpuState(str, Enum):
    UNKNOWN = "unknown"
    GENERATING = "generating"
    DRAINED = "drained"
    LENT = "lent"
    RECLAIMING = "reclaiming"


Phase = Literal["idle", "rollout", "train"]


class _Payload(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PhaseInfo(_Payload):
    phase: Phase
    step: int = Field(ge=0)
    started_at: float
    policy_version: int = Field(0, ge=0)
    policy_path: str | None = Field(None, description="directory of the latest policy weights (teacher for sessions)")


class Progress(_Payload):
    """A rollout worker's report (client.report_progress)."""

    worker: str
    node: str
    # Non-negative like every GPU index of the schema: a negative one would reach the scheduler's state machines
    # and their GpuStatus records (gpu >= 0), where it would fail every tick instead of this one payload.
    gpus: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_WORKER_GPUS)
    active: int = Field(ge=0)
    finished: int = Field(ge=0)
    total: int = Field(0, ge=0)
    phase: Phase
    step: int = Field(0, ge=0)
    # Sum over active requests of generated tokens, and of their expected remaining tokens; lets the
    # scheduler estimate the remaining tail without knowing the model.
    tokens_done: int = Field(0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0)
    remaining_s: float | None = Field(None, ge=0, description="worker's own estimate of its remaining time, if any")
    # The GPU-memory handshake: a worker that finished says it released its GPU memory (vLLM sleep, KV cache
    # freed, allocator cache emptied). None: the worker does not take part (lendable unless the scheduler
    # requires the handshake); False: it still holds its memory, never lent.
    mem_released: bool | None = Field(None, description="the worker released its GPU memory (None: not reported)")
    free_mem: int | None = Field(None, ge=0, description="bytes free on the worker's GPU after the release, if measured")
    ts: float


class GpuTelemetry(_Payload):
    node: str
    gpu: int = Field(ge=0)
    util: float = Field(ge=0, le=100)
    mem_used: int = Field(ge=0, description="bytes")
    mem_total: int = Field(ge=0, description="bytes")
    power_w: float | None = None
    processes: list[int] = Field(default_factory=list, description="pids using the GPU")
    simulated: bool
    error: str | None = None
    ts: float
    # A simulated GPU that is a share of a real CUDA device (`tailspec demo --device cuda`): that device's NVML
    # readings, for the whole device, and how it is shared; None elsewhere.
    device: str | None = Field(None, max_length=240, description="the real device this simulated GPU is a share of")
    device_util: float | None = Field(None, ge=0, le=100)
    device_mem_used: int | None = Field(None, ge=0, description="bytes")
    device_mem_total: int | None = Field(None, ge=0, description="bytes")


class NodeHealth(_Payload):
    """Which GPUs one node's telemetry monitor sampled and which of them failed: the part of its samples that changes
    only when a GPU fails, recovers, appears or goes away. Written with the node's samples and expiring with them, so
    a dead monitor's GPUs lose it too; its bytes stay the same from one sample to the next while nothing changes (no
    time in it), which lets the scheduler read it every tick instead of every GPU's sample."""

    node: str
    gpus: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_WORKER_GPUS, description="GPUs sampled")
    errors: dict[Annotated[int, Field(ge=0)], str] = Field(default_factory=dict,
                                                           description="GPU → its telemetry error, as in its sample")


class GpuStatus(_Payload):
    """The scheduler's view of one GPU (its state machine)."""

    node: str
    gpu: int = Field(ge=0)
    state: GpuState
    since: float
    worker: str | None = None
    lease_token: int | None = None
    session_id: str | None = None


class Lease(_Payload):
    node: str
    gpu: int = Field(ge=0)
    token: int = Field(ge=1, description="fencing token, strictly increasing per cluster")
    holder: str
    granted_at: float
    ttl_s: float = Field(gt=0)
    epoch: int | None = Field(None, ge=1, description="leader epoch that granted it; renewable only while that "
                              "epoch leads (None: granted outside leadership, by tools and tests)")


class SchedulerLeader(_Payload):
    """Who leads the cluster's schedulers (scheduler/leader.py): the value of the PX-expiring leader key."""

    epoch: int = Field(ge=1, description="fencing epoch, strictly increasing per cluster (INCR scheduler:epoch)")
    holder: str = Field(description="the leading scheduler instance: node, pid and a random suffix")
    node: str
    pid: int = Field(ge=0)
    since: float = Field(description="time.time() of the take-over")


class SessionInfo(_Payload):
    session_id: str
    node: str
    gpu: int = Field(ge=0)
    lease_token: int = Field(ge=1)
    status: Literal["starting", "running", "stopping", "stopped", "failed"]
    step: int = Field(0, ge=0)
    loss: float | None = None
    tokens: int = Field(0, ge=0)
    started_at: float
    stopped_at: float | None = None
    stop_reason: str | None = None
    pid: int | None = Field(None, ge=1, description="the session process on its node (set by the session)")
    stop_latency_s: float | None = None
    drafter_version: int | None = None
    mem_needed: int | None = Field(None, ge=0, description="bytes the session computed it needs: teacher + drafter + "
                                   "gradients + optimizer + activations")
    mem_free: int | None = Field(None, ge=0, description="bytes free on its GPU when it checked (before loading)")
    declined: bool = Field(False, description="the session did not fit and gave the GPU back without loading")
    released_at: float | None = Field(None, description="when the session freed its GPU (its last merge's state on "
                                      "the host): the GPU is back for the trainer, the merge may still be writing")


class Sample(_Payload):
    """One rollout sample for drafter training: ids and numbers only, no tensors (shipped targets are named by path)."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    policy_version: int = Field(ge=0)
    group_id: str | None = None
    ts: float = Field(default_factory=time.time)
    # the rollout's own training targets for it, when shipped (drafter_trainer/rollout_targets.py)
    states_path: str | None = Field(None, max_length=4096, pattern=r"^/", description="directory of the rollout's "
                                    "targets file, absolute: sessions on any node read it")
    states_key: str | None = Field(None, max_length=64, description="this sample's entry in that file")


class DrafterVersion(_Payload):
    version: int = Field(ge=0)
    path: str
    policy_version: int = Field(ge=0)
    acceptance_length: float | None = Field(None, description="expected acceptance length at validation_k")
    validation_k: int | None = Field(None, ge=1, le=64, description="chain k of the validation (None: older, 4)")
    baseline_acceptance_length: float | None = None
    promoted: bool
    created_at: float
    session_id: str | None = None
    note: str | None = None
    # The promotion decision (versions.decide): paired gain candidate − current per held-out sample.
    baseline_version: int | None = Field(None, description="the current version the candidate was scored against")
    pairs: int | None = Field(None, ge=0, description="held-out samples scored for both (the test's n)")
    gain_mean: float | None = None
    gain_lcb: float | None = Field(None, description="one-sided lower confidence bound of the mean paired gain")
    decision: str | None = Field(None, description="why it was or was not promoted")
    lineage_head: int | None = Field(None, ge=0, description="lineage head number the candidate was taken from")
    lineage_steps: int | None = Field(None, ge=0, description="optimizer steps merged into that head")
    scored_under: dict[str, float] | None = Field(None, description="strategy → weight (None: chain validation_k)")
    rank_rates: list[list[float]] | None = Field(None, description="mean rate per [depth][sibling rank] there")


class LineageHead(_Payload):
    """The head of the one drafter lineage every session contributes to (drafter_trainer.lineage)."""

    number: int = Field(ge=1, description="increases by one with every merge")
    path: str = Field(description="directory of the head's weights and optimizer state")
    steps: int = Field(ge=0, description="optimizer steps merged into the lineage, over all sessions")
    tokens: int = Field(0, ge=0)
    merges: int = Field(0, ge=0)
    policy_version: int = Field(0, ge=0, description="teacher policy version of the last merged work")
    session_id: str | None = Field(None, description="the session whose merge made this head")
    round: int = Field(0, ge=0, description="last synchronous round it holds (drafter_trainer/rounds.py), else 0")
    updated_at: float


class DrafterHealth(_Payload):
    """Staleness: the current drafter's acceptance on the newest samples beside its value at promotion."""

    drafter_version: int | None = None
    policy_version: int = Field(ge=0)
    step: int | None = Field(None, ge=0, description="RL step, when the RL loop recorded it")
    acceptance_length: float = Field(ge=0, description="expected acceptance length now, current teacher")
    at_promotion: float | None = Field(None, description="its validated acceptance length when promoted")
    samples: int = Field(0, ge=0)
    source: str = Field("validation", description="who measured it: validation (a session) or the RL loop")
    ts: float = Field(default_factory=time.time)


class GuardStatus(_Payload):
    """A rollout worker's latest drafter health-guard verdict (rollout/health_guard.py). While `tripped`,
    speculation is off on that worker until another drafter version loads and is judged healthy."""

    worker: str
    backend: str = Field("native", description="native engine or vllm")
    tripped: bool
    version: int | None = Field(None, description="the drafter version judged")
    event: str = Field(description="what armed the guard: load, reload, policy_sync, rollback")
    live: float = Field(description="tokens per target forward over the window")
    validated: float | None = Field(None, description="tokens per forward the validation predicts at the window's k")
    steps: int = Field(ge=0, description="speculative decode steps in the window")
    reason: str = ""
    ts: float = Field(default_factory=time.time)


class RolloutStats(_Payload):
    """Per-phase rollout figures a worker publishes (strategy mix, acceptance, speed)."""

    worker: str
    step: int = Field(ge=0)
    tokens: int = Field(ge=0)
    seconds: float = Field(ge=0)
    target_forwards: int = Field(ge=0)
    drafted: int = Field(ge=0)
    accepted: int = Field(ge=0)
    acceptance_length: float = Field(ge=0, description="tokens emitted per target forward")
    strategy_mix: dict[str, int] = Field(default_factory=dict, description="chain k or tree label → decode steps")
    drafter_version: int | None = None
    baseline_tokens_per_s: float | None = Field(
        None, ge=0, description="tokens/s of plain decoding (k=0) on the same worker and batch sizes; "
        "the dashboards' rollout speedup = (tokens / seconds) / this")
    ts: float


class Event(_Payload):
    kind: Literal[
        "lease_granted", "lease_renewed", "lease_revoked", "lease_expired", "session_started",
        "session_stopped", "session_failed", "phase", "version_promoted", "version_rejected", "warning",
        "gpu_idle", "lineage_merged", "session_declined", "leader_elected", "drafter_guard",
    ]
    node: str | None = None
    gpu: int | None = None
    detail: dict[str, Any] = Field(default_factory=dict)
    ts: float = Field(default_factory=time.time)


RedisType = Literal["string", "hash", "stream", "counter", "list", "set"]


@dataclass(frozen=True)
class KeySpec:
    name: str
    template: str  # after the `tailspec:{cluster}:` prefix
    redis_type: RedisType
    owner: str
    payload: type[BaseModel] | None
    doc: str


KEYS: dict[str, KeySpec] = {
    s.name: s
    for s in [
        KeySpec("phase", "phase", "string", "RL framework (client)", PhaseInfo,
                "current RL phase, step and policy version; each change is also PUBLISHed on a channel of this name, "
                "where the scheduler waits between ticks"),
        KeySpec("progress", "progress:{worker}", "string", "rollout worker (client)", Progress,
                "latest progress report of one worker; PX-expiring so a dead worker disappears"),
        KeySpec("workers", "workers", "set", "rollout worker (client)", None, "names of workers that reported"),
        KeySpec("telemetry", "gpu:{node}:{gpu}", "string", "telemetry monitor", GpuTelemetry,
                "latest telemetry sample of one GPU"),
        KeySpec("gpu_health", "gpu_health:{node}", "string", "telemetry monitor", NodeHealth,
                "the GPUs one node's monitor sampled and their errors, written with its samples and expiring with "
                "them; the scheduler reads it every tick and a GPU's sample only while the GPU is drained"),
        KeySpec("gpus", "gpus", "set", "telemetry monitor", None, "'{node}:{gpu}' of every known GPU"),
        KeySpec("telemetry_history", "history:gpu", "stream", "telemetry monitor", GpuTelemetry,
                "capped stream (MAXLEN ~) of telemetry samples, field 'data'"),
        KeySpec("gpu_status", "gpu_status:{node}:{gpu}", "string", "scheduler", GpuStatus, "state machine of one GPU"),
        KeySpec("status_history", "history:status", "stream", "scheduler", GpuStatus,
                "capped stream of GPU state transitions (timeline), field 'data'"),
        KeySpec("lease", "lease:{node}:{gpu}", "string", "scheduler", Lease,
                "the lease on one GPU: SET NX PX; value carries the fencing token"),
        KeySpec("fence", "fence", "counter", "scheduler", None, "INCR source of fencing tokens"),
        KeySpec("session", "session:{session_id}", "string", "trainer session", SessionInfo,
                "a training session's status, step and loss"),
        KeySpec("sessions", "sessions", "set", "scheduler", None, "ids of all sessions"),
        KeySpec("revoke", "revoke:{node}:{gpu}", "string", "scheduler", None,
                "revocation flag (fencing token); the revoke also PUBLISHes the token on a channel of this name"),
        KeySpec("samples", "samples", "stream", "RL framework (client)", Sample,
                "capped stream of rollout samples, field 'data'"),
        KeySpec("dropped", "dropped", "hash", "drafter trainer / client", None,
                "dropped samples and client messages by reason → count"),
        KeySpec("drafter_current", "drafter:current", "string", "drafter trainer (versions)", DrafterVersion,
                "the promoted drafter version workers load at phase start"),
        KeySpec("drafter_versions", "drafter:versions", "list", "drafter trainer (versions)", DrafterVersion,
                "history of every candidate, promoted or not (RPUSH)"),
        KeySpec("drafter_counter", "drafter:counter", "counter", "drafter trainer (versions)", None,
                "INCR source of drafter version numbers"),
        KeySpec("drafter_proposed", "drafter:proposed", "string", "drafter trainer (sessions)", None,
                "'NUMBER STEPS': lineage head last proposed as a candidate and its optimizer steps (skips proposing "
                "one head twice, and heads with fewer than trainer.propose_min_steps new steps)"),
        KeySpec("drafter_validating", "drafter:validating", "string", "drafter trainer (sessions)", None,
                "'NUMBER SESSION': the one session validating a lineage head now (SET NX PX, released when its "
                "validation ends or is cut short); the others train instead of scoring the same head again"),
        KeySpec("drafter_validation", "drafter:validation", "hash", "drafter trainer (versions)", None,
                "paired scores of the validation in progress: id = 'HEAD:BASELINE:K', mix = the strategy mix it "
                "scores under (JSON; none: a chain of K), per held-out sample key 'CANDIDATE CURRENT ANCHORS' "
                "(finished by a later session, on the version store's pending copy of HEAD)"),
        KeySpec("drafter_health", "history:drafter_health", "stream", "drafter trainer / RL loop", DrafterHealth,
                "current drafter's acceptance on the newest samples beside its value at promotion"),
        KeySpec("drafter_guard", "drafter:guard", "hash", "rollout worker", GuardStatus,
                "each rollout worker's latest health-guard verdict: field = worker name"),
        KeySpec("lineage_head", "lineage:head", "string", "drafter trainer (lineage)", LineageHead,
                "head of the drafter lineage; replaced only by a fenced compare-and-swap merge"),
        KeySpec("lineage_contributions", "lineage:contributions", "hash", "drafter trainer (lineage)", None,
                "'{session}:steps' → optimizer steps (rounds: entries) merged, '{session}:seq' → last merge"),
        KeySpec("lineage_rounds", "lineage:rounds", "hash", "drafter trainer (rounds)", None, "'open' → round "
                "taking entries; '{r}:in' → its entries [{s, p, t, w, a}], '{r}:dl' → deadline, '{r}:closed', "
                "'{r}:g' → its process group, '{r}:mode', '{r}:votes', '{r}:commit' (1 applied, 0 failed, 2 lost); "
                "'last', 'holders' → the newest applied round and who holds it; 'failed'; 'group:*'. A group's "
                "rendezvous keys are strings under 'lineage:rounds:collective:{group}/', expiring"),
        KeySpec("lineage_members", "lineage:members", "hash", "drafter trainer (rounds)", None,
                "session → JSON {hb: last seen (Redis TIME), joined: first round it is waited for in}"),
        KeySpec("rollout_stats", "history:rollout", "stream", "rollout worker", RolloutStats,
                "per-phase rollout figures, field 'data'"),
        KeySpec("counters", "counters", "hash", "scheduler, sessions", None,
                "float counters: idle_gpu_seconds, lent_gpu_seconds, sessions_started/stopped/preempted/declined, "
                "drafter_guard_trips; each finished session adds session_ready_seconds, session_train_seconds (of "
                "it session_round_wait_seconds), session_validate_seconds, session_seconds, session_renew_seconds (its "
                "lease renewal thread's CPU)"),
        KeySpec("events", "history:events", "stream", "any", Event, "capped event log, field 'data'"),
        KeySpec("scheduler_heartbeat", "scheduler:heartbeat", "string", "scheduler (leader)", None,
                "time.time() of the leading scheduler's last loop, PX-expiring; written with the leader key's "
                "renewal, so only the leader writes it"),
        KeySpec("leader", "scheduler:leader", "string", "scheduler (leader)", SchedulerLeader,
                "the leading scheduler and its epoch; PX-expiring (scheduler.leader_ttl_s), renewed every tick"),
        KeySpec("leader_epoch", "scheduler:epoch", "counter", "scheduler", None,
                "INCR source of leader epochs"),
    ]
}


def text(v: bytes | str) -> str:
    """A Redis reply as text: the clients here return bytes, one made with decode_responses returns str."""
    return v.decode() if isinstance(v, bytes) else v


def gpu_of(member: bytes | str) -> tuple[str, int] | None:
    """(node, gpu) of a `gpus` set member ("node:gpu", as the telemetry monitor adds it); None when malformed."""
    node, _, idx = text(member).rpartition(":")
    return (node, int(idx)) if node and idx.isdigit() else None


def key(cluster: str, name: str, **fields: Any) -> str:
    """Full Redis key for schema entry `name`, e.g. key("c", "lease", node="n0", gpu=1)."""
    try:
        spec = KEYS[name]
    except KeyError:
        raise StateError(f"unknown state key {name!r}; known: {', '.join(sorted(KEYS))}") from None
    try:
        suffix = spec.template.format(**fields)
    except KeyError as e:
        raise StateError(f"state key {name!r} needs field {e.args[0]!r} ({spec.template})") from None
    return prefix(cluster) + suffix


def prefix(cluster: str) -> str:
    """Every key of a cluster starts with this; keys outside the schema (the demo's own work queues) too, so
    one SCAN or one ACL pattern covers a cluster."""
    return f"tailspec:{cluster}:"


M = TypeVar("M", bound=BaseModel)


def encode(payload: BaseModel) -> bytes:
    return payload.model_dump_json().encode()


def decode(model: type[M], raw: bytes | str | None, where: str = "") -> M:
    """Parse and validate a JSON payload; raises StateError naming `where` and the bad field."""
    if raw is None:
        raise StateError(f"{where or model.__name__}: no value")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(payload)"
        raise StateError(f"{where or model.__name__}: bad {model.__name__} payload at {field}: {first['msg']}") from None


def encode_dict(d: dict[str, Any]) -> bytes:
    """JSON for free-form records (counters, details); rejects non-JSON types instead of pickling."""
    return json.dumps(d, separators=(",", ":"), allow_nan=False).encode()


def schema_table() -> str:
    """Markdown table of every key (used by docs and `tailspec config schema`)."""
    rows = ["| key | type | owner | payload | meaning |", "| --- | --- | --- | --- | --- |"]
    for s in KEYS.values():
        rows.append(
            f"| `tailspec:{{cluster}}:{s.template}` | {s.redis_type} | {s.owner} | "
            f"{s.payload.__name__ if s.payload else '-'} | {s.doc} |"
        )
    return "\n".join(rows)


def put(r: Any, redis_key: str, payload: BaseModel, px_ms: int | None = None) -> None:
    """SET a validated payload (optionally expiring)."""
    r.set(redis_key, encode(payload), px=px_ms)


def get(r: Any, redis_key: str, model: type[M]) -> M | None:
    """GET and validate; None when absent, StateError when malformed."""
    raw = r.get(redis_key)
    return None if raw is None else decode(model, raw, where=redis_key)


def append(r: Any, redis_key: str, payload: BaseModel, maxlen: int = 20_000) -> bytes:
    """XADD a payload to a capped stream (approximate trimming keeps it O(1))."""
    return r.xadd(redis_key, {"data": encode(payload)}, maxlen=maxlen, approximate=True)


def read_stream(
    r: Any, redis_key: str, model: type[M], after: bytes | str = "0", count: int | None = None,
    on_bad: Any = None,
) -> tuple[list[tuple[bytes, M]], bytes | str]:
    """XRANGE entries after id `after` → ([(id, payload)], last id seen). Malformed entries are skipped
    and reported to `on_bad(entry_id, error)` so one bad writer never breaks a reader."""
    start = "-" if after in ("0", b"0", "0-0") else b"(" + (after if isinstance(after, bytes) else after.encode())
    entries = r.xrange(redis_key, min=start, max="+", count=count)
    out: list[tuple[bytes, M]] = []
    last = after
    for entry_id, fields in entries:
        last = entry_id
        try:
            out.append((entry_id, decode(model, fields.get(b"data") or fields.get("data"), where=redis_key)))
        except StateError as e:
            if on_bad is not None:
                on_bad(entry_id, e)
    return out, last
