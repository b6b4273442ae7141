"""The built-in synthetic reasoning task: a running-sum scratchpad with heavy-tailed length.

Prompt: ``S:3,7,5,9=``. Gold response: ``0+3=3;3+7=0;0+5=5;5+9=4;#4`` then EOS — one scratchpad step per
number, each step "previous total + next number = new total" (mod `modulus`), then the final answer.

Why this task:
- Each step depends on the previous one, like a chain of thought: one slip makes the final answer wrong,
  so a small policy is imperfect and RL has something to improve.
- The number of steps is drawn from a discretized log-normal, so gold response lengths are heavy-tailed
  like reasoning RL's (most short, a few very long): at the defaults p50 ≈ 45 tokens and p99/p50 ≈ 5.
  That long tail is exactly what leaves GPUs idle during rollouts.
- The reward is verifiable exactly (the final answer), with an optional format score.
- The scratchpad is locally predictable (copy the previous total, copy the next number), so a good
  drafter can earn long acceptances — and one trained on an older policy can still go stale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from tailspec.config import TaskConfig

_WELL_FORMED = re.compile(r"^(?:(\d+)\+(\d+)=(\d+);)*#(\d+)$")


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    modulus: int

    @property
    def prompt(self) -> str:
        return "S:" + ",".join(str(x) for x in self.numbers) + "="

    @property
    def answer(self) -> int:
        return sum(self.numbers) % self.modulus

    @property
    def gold(self) -> str:
        total, steps = 0, []
        for x in self.numbers:
            new = (total + x) % self.modulus
            steps.append(f"{total}+{x}={new};")
            total = new
        return "".join(steps) + f"#{total}"


def sample_steps(rng: np.random.Generator, cfg: TaskConfig, n: int) -> np.ndarray:
    """Heavy-tailed step counts: round(exp(N(log median, sigma))), clipped to [steps_min, steps_max]."""
    raw = np.exp(rng.normal(np.log(cfg.steps_median), cfg.steps_sigma, size=n))
    return np.clip(np.rint(raw), cfg.steps_min, cfg.steps_max).astype(int)


def sample_problems(n: int, cfg: TaskConfig | None = None, seed: int = 0) -> list[Problem]:
    cfg = cfg or TaskConfig()
    rng = np.random.default_rng(seed)
    steps = sample_steps(rng, cfg, n)
    return [Problem(tuple(int(x) for x in rng.integers(0, cfg.modulus, size=m)), cfg.modulus) for m in steps]


@dataclass(frozen=True)
class Graded:
    reward: float
    correct: bool
    well_formed: bool
    answer: int | None


def grade(problem: Problem, response: str, cfg: TaskConfig | None = None) -> Graded:
    """Exact check of the final answer (1.0 / 0.0) plus `format_score` for a well-formed scratchpad.

    `response` is the decoded text after the prompt with special tokens removed; anything that is not
    ``step;step;…#answer`` is malformed and earns 0 (no partial credit for an answer-looking suffix).
    """
    cfg = cfg or TaskConfig()
    m = _WELL_FORMED.match(response.strip())
    if m is None:
        return Graded(0.0, False, False, None)
    answer = int(m.group(4))
    correct = answer == problem.answer
    return Graded((1.0 if correct else 0.0) + cfg.format_score, correct, True, answer)


def parse_prompt(prompt: str, modulus: int) -> Problem:
    """Inverse of Problem.prompt; raises ValueError naming what is wrong."""
    m = re.fullmatch(r"S:(\d+(?:,\d+)*)=", prompt)
    if m is None:
        raise ValueError(f"not a runsum prompt: {prompt[:40]!r} (expected 'S:a,b,c=')")
    nums = tuple(int(x) for x in m.group(1).split(","))
    if any(x >= modulus for x in nums):
        raise ValueError(f"prompt numbers must be < modulus {modulus}: {prompt[:40]!r}")
    return Problem(nums, modulus)
