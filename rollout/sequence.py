"""Requests as the caller sees them: sampling parameters in, token ids + logprobs + stats out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy; top_k 0 and top_p 1.0 = off.

    stop_token_ids None = the model's EOS; the stop token is included in the output (as HF `generate`).
    seed None = drawn from the engine's own generator at admission (reproducible per engine seed).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class RequestStats:
    target_forwards: int = 0  # verify forwards this request took part in
    drafted: int = 0  # draft tokens proposed for it
    accepted: int = 0  # of which accepted

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target forward (1 = no gain from speculation)."""
        return (self.accepted + self.target_forwards) / max(self.target_forwards, 1)


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    # log p(token) under the policy's raw distribution (softmax of the logits: no temperature, no truncation)
    logprobs: list[float]
    # log of the processed distribution the token was sampled from (temperature, top-k, top-p applied);
    # 0.0 for greedy rows
    sampling_logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    stats: RequestStats = field(default_factory=RequestStats)
    # (aux states [n-1, A], logits [G, V]) on the host when the engine records them (rollout/states.py)
    states: tuple[Any, Any] | None = None
