"""The built-in synthetic reasoning task: a running-sum scratchpad with heavy-tailed length.

Prompt: ``a3,b7,c5,d9=``. Gold response: ``a:0+3=3;b:3+7=0;c:0+5=5;d:5+9=4;#4`` then EOS — one scratchpad
step per number, each step "tag: previous total + next number = new total" (mod `modulus`), then the
final answer. Each number carries a unique letter tag so a step finds its operand by content (the tag),
not by counting digits — with bare digits a tiny model cannot tell which of the repeated digits comes
next and never learns the task.

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

from tailspec.core.config import TaskConfig

TAGS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_WELL_FORMED = re.compile(r"^(?:[A-Za-z]:(\d+)\+(\d+)=(\d+);)*#(\d+)$")


@dataclass(frozen=True)
class Problem:
    numbers: tuple[int, ...]
    modulus: int

    @property
    def prompt(self) -> str:
        return ",".join(f"{t}{x}" for t, x in zip(TAGS, self.numbers)) + "="

    @property
    def answer(self) -> int:
        return sum(self.numbers) % self.modulus

    @property
    def gold(self) -> str:
        total, steps = 0, []
        for t, x in zip(TAGS, self.numbers):
            new = (total + x) % self.modulus
            steps.append(f"{t}:{total}+{x}={new};")
            total = new
        return "".join(steps) + f"#{total}"


def sample_steps(rng: np.random.Generator, cfg: TaskConfig, n: int) -> np.ndarray:
    """Heavy-tailed step counts: round(exp(N(log median, sigma))), clipped to [steps_min, steps_max]."""
    raw = np.exp(rng.normal(np.log(cfg.steps_median), cfg.steps_sigma, size=n))
    return np.clip(np.rint(raw), cfg.steps_min, cfg.steps_max).astype(int)


def sample_problems(n: int, cfg: TaskConfig | None = None, seed: int = 0) -> list[Problem]:
    cfg = cfg or TaskConfig()
    rng = np.random.default_rng(seed)
    if cfg.steps_max > len(TAGS):
        raise ValueError(f"task.steps_max={cfg.steps_max} exceeds the {len(TAGS)} step tags")
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
    ``t:a+b=c;…#answer`` is malformed and earns 0 (no partial credit for an answer-looking suffix).
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
    parts = prompt[:-1].split(",") if prompt.endswith("=") else []
    ok = bool(parts) and len(parts) <= len(TAGS) and all(
        len(q) >= 2 and q[0] == TAGS[i] and q[1:].isdigit() for i, q in enumerate(parts))
    if not ok:
        raise ValueError(f"not a runsum prompt: {prompt[:40]!r} (expected 'a3,b7,c5=')")
    nums = tuple(int(q[1:]) for q in parts)
    if any(x >= modulus for x in nums):
        raise ValueError(f"prompt numbers must be < modulus {modulus}: {prompt[:40]!r}")
    return Problem(nums, modulus)
