"""Shared by tests/test_vllm_*.py: the tiny policy, its drafters (built once, cached), and a small in-process
vLLM engine configuration for 2 CPU cores."""

from __future__ import annotations

from functools import cache
from pathlib import Path

MAX_TOKENS = 40
N_PROMPTS = 4


@cache
def tiny() -> Path:
    from tailspec.tasks.policy import get_policy

    return get_policy("tiny", progress=False)


@cache
def micro() -> Path:
    from tailspec.tasks.policy import get_policy

    return get_policy("micro", progress=False)


@cache
def drafters() -> dict[str, Path]:
    """Untrained and trained EAGLE-3 drafters of the tiny policy, exported by the trainer's export code."""
    from tailspec.benchmarks.vllm_kit import cached_drafters

    return cached_drafters(tiny())


@cache
def prompts(n: int = N_PROMPTS) -> list[list[int]]:
    from tailspec.benchmarks.vllm_kit import task_prompts

    return task_prompts(tiny(), n)


def engine_kwargs(**kw) -> dict:
    from tailspec.benchmarks.vllm_kit import in_process_engine

    return {"max_model_len": 256, "max_num_seqs": 8, "dtype": "float32", "seed": 0, **in_process_engine(), **kw}


def token_ids(result) -> list[list[int]]:
    return [c.token_ids for c in result.completions]
