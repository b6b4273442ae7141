"""Requests as the caller sees them: sampling parameters in, token ids + logprobs + stats out."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


def check_request(prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_seq_len: int, max_stop_ids: int,
                  stop_ids: Callable[[], tuple[int, ...]]) -> None:
    """Raise ValueError naming what is wrong with a request for an engine of this vocabulary, cache length and stop
    id capacity (`stop_ids()`: the request's stop ids, EOS included); nothing is computed before this passes."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if len(prompt) == 0:
        raise ValueError("empty prompt: a request needs at least one token (e.g. BOS)")
    bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids outside the vocabulary 0..{vocab_size - 1}: {bad[:8]}")
    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {params.max_tokens!r}")
    if len(prompt) + params.max_tokens > max_seq_len:
        raise ValueError(
            f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the cache "
            f"(max_seq_len={max_seq_len})"
        )
    if not (isinstance(params.temperature, (int, float)) and math.isfinite(params.temperature) and params.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature!r}")
    if not (isinstance(params.top_p, (int, float)) and 0 < params.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p!r}")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {params.top_k!r}")
    stops = stop_ids()
    if len(stops) > max_stop_ids:
        raise ValueError(f"{len(stops)} stop token ids; at most {max_stop_ids} (max_stop_ids)")
    bad = [t for t in stops if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop token ids outside the vocabulary 0..{vocab_size - 1}: {bad}")
    if params.seed is not None and (not isinstance(params.seed, int) or not 0 <= params.seed < 2**63):
        raise ValueError(f"seed must be an int in [0, 2**63), got {params.seed!r}")
