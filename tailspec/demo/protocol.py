"""The demo's work protocol: its RL loop hands each rollout worker a `WorkItem` (requests, policy and drafter
to use) through a Redis list and gets a `WorkResult` back through another. JSON only, validated on both ends.

This is the demo's own wiring between its loop and its workers — a user's RL framework drives its rollout
workers its own way — so it lives beside the demo, not in the cluster-state schema (tailspec.core.state) the
scheduler, trainer and dashboards share. The keys sit under the cluster's prefix all the same."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tailspec.core.state import prefix


def work_key(cluster: str, worker: str) -> str:
    """One rollout worker's queue of WorkItems (RPUSH by the loop, BLPOP by the worker)."""
    return f"{prefix(cluster)}demo:work:{worker}"


def results_key(cluster: str) -> str:
    """Finished WorkResults back to the loop (emptied at the start of each round)."""
    return f"{prefix(cluster)}demo:results"


class _Payload(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkRequest(_Payload):
    rid: int = Field(ge=0)
    prompt_ids: list[int]
    seed: int


class WorkItem(_Payload):
    """The demo's RL loop → one rollout worker: generate these requests with this policy and drafter."""

    step: int = Field(ge=0)
    policy_path: str | None = None
    policy_version: int = Field(0, ge=0)
    drafter_path: str | None = Field(None, description="drafter checkpoint directory; None = no speculation")
    drafter_version: int | None = None
    selector: Literal["adaptive", "fixed", "beg", "threshold"] = "adaptive"
    k: int = Field(4, ge=0, le=16)
    temperature: float = Field(1.0, ge=0)
    max_tokens: int = Field(512, ge=1)
    rollout: dict[str, Any] | None = Field(None, description="the run's `rollout` config section (a RolloutConfig "
                                           "dump; it wins over selector and k above); None = its defaults")
    requests: list[WorkRequest] = Field(default_factory=list)
    warmup: bool = Field(False, description="load the policy and drafter and time the cost model on these "
                         "requests, then answer with no outputs (an engine's start-up, before the first rollout)")
    cost_model: dict[str, Any] | None = Field(None, description="a cost table t(b, k) (CostModel.to_dict) to start "
                                              "from instead of timing one: a replacement worker takes the one its "
                                              "predecessor reported; a warm-up still runs its steps (they seed the "
                                              "acceptance tracker) and keeps this table in place of its timings")
    states_dir: str | None = Field(None, description="record each request's training targets and write them under "
                                   "this directory (drafter_trainer/rollout_targets.py); None = do not")
    stop: bool = False


class WorkOutput(_Payload):
    rid: int = Field(ge=0)
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    target_forwards: int = Field(ge=0)
    drafted: int = Field(ge=0)
    accepted: int = Field(ge=0)
    states_path: str | None = Field(None, description="where the rollout wrote this request's training targets")
    states_key: str | None = None


class WorkResult(_Payload):
    worker: str
    step: int = Field(ge=0)
    outputs: list[WorkOutput]
    started_at: float
    finished_at: float
    decode_steps: int = Field(0, ge=0)
    strategy_mix: dict[str, int] = Field(default_factory=dict)
    # what a cluster projection is calibrated with (`tailspec simulate --calibrate`): the engine's own costs
    setup_s: float = Field(0.0, ge=0, description="policy/drafter load and engine build before the first request")
    decode_s: float = Field(0.0, ge=0, description="sum of the decode steps' wall times (admissions excluded)")
    drained_at: float | None = Field(None, description="when the worker reported its drain (before building this)")
    accepted_by_k: dict[str, list[int]] = Field(default_factory=dict, description="k -> [rows drafted, drafts accepted]")
    cost_model: dict[str, Any] | None = Field(None, description="the engine's cost table t(b, k) (CostModel.to_dict): "
                                              "the warm-up's with the warm-up result, after a rollout what the "
                                              "rollout's own steps taught it")
    guard: list[dict[str, Any]] = Field(default_factory=list, description="drafter health verdicts reached "
                                        "during this item (rollout.health_guard.Verdict fields)")
    error: str | None = None


