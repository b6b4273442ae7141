"""Test data for the trainer tests: rollout samples of a cached task policy (see tailspec.benchmarks.trainer)."""

from __future__ import annotations

from pathlib import Path

from tailspec.core.state import Sample


def policy_samples(preset: str, n: int, seed: int = 0, max_new_tokens: int | None = 128) -> tuple[Path, list[Sample]]:
    from tailspec.tasks.samples import policy_samples as make

    return make(preset, n, seed, max_new_tokens=max_new_tokens)
