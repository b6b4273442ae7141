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

Two scratchpad styles, both well-formed: the main one above, and an alternative that echoes the prompt's
layout, tag and number first, then "+ previous total = new total", steps ended by ``,``:
``a3+0=3,b7+3=0,c5+0=5,d9+5=4,#4``. The same work per step (look the number up by its tag, copy the previous
total, add), one token shorter, but almost every token follows a different one than in the main style, so a
drafter trained on main-style text predicts it badly. Policy presets write a share of their pre-training
corpus in it (`task.alt_style_rate`, default the preset's: 10% for `deep`, none for the others), and a
well-formed response in it earns `task.style_bonus` on top of its reward: GRPO then moves the policy from the
main style toward the alternative over a run, a real drift of its output distribution driven by the reward,
which a drafter trained once on the initial policy does not follow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from tailspec.core.config import TaskConfig

TAGS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAIN, ALT = "main", "alt"  # the two scratchpad styles (module docstring)
_WELL_FORMED = {
    MAIN: re.compile(r"^(?:[A-Za-z]:(\d+)\+(\d+)=(\d+);)*#(\d+)$"),  # a:0+3=3;b:3+7=0;#0
    ALT: re.compile(r"^(?:[A-Za-z](\d+)\+(\d+)=(\d+),)*#(\d+)$"),  # a3+0=3,b7+3=0,#0
}


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
        return self.gold_in(MAIN)

    def gold_in(self, style: str) -> str:
        """The gold response in a scratchpad style (MAIN: ``a:0+3=3;…#4``, ALT: ``a3+0=3,…#4``)."""
        if style not in _WELL_FORMED:
            raise ValueError(f"unknown scratchpad style {style!r}; choose from {', '.join(_WELL_FORMED)}")
        total, steps = 0, []
        for t, x in zip(TAGS, self.numbers):
            new = (total + x) % self.modulus
            steps.append(f"{t}:{total}+{x}={new};" if style == MAIN else f"{t}{x}+{total}={new},")
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
    style: str | None = None  # MAIN or ALT for a well-formed response


def grade(problem: Problem, response: str, cfg: TaskConfig | None = None) -> Graded:
    """Exact check of the final answer (1.0 / 0.0), plus `format_score` for a well-formed scratchpad, plus
    `style_bonus` for one in the alternative style.

    `response` is the decoded text after the prompt with special tokens removed; anything that is not a whole
    scratchpad in one style (``t:a+b=c;…#answer`` or ``tb+a=c,…#answer``) is malformed and earns 0 (no partial
    credit for an answer-looking suffix, none for mixing the styles). A bare ``#answer`` counts as MAIN.
    """
    cfg = cfg or TaskConfig()
    text = response.strip()
    for style, pattern in _WELL_FORMED.items():
        m = pattern.match(text)
        if m is not None:
            break
    else:
        return Graded(0.0, False, False, None)
    answer = int(m.group(4))
    correct = answer == problem.answer
    bonus = cfg.style_bonus if style == ALT else 0.0
    return Graded((1.0 if correct else 0.0) + cfg.format_score + bonus, correct, True, answer, style)


def style_of(response: str) -> str | None:
    """MAIN or ALT for a well-formed response, None for a malformed one."""
    text = response.strip()
    return next((style for style, pattern in _WELL_FORMED.items() if pattern.match(text)), None)


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
