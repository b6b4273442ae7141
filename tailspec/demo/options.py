"""The demo's options (what `tailspec demo` flags set), apart from the run so that building the CLI's parser
imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Mode = Literal["cotrained", "frozen", "nospec"]


@dataclass
class DemoOptions:
    # 10 steps at lr 1e-4: enough for GRPO to move the deep policy from its main scratchpad style toward the one
    # the reward's style bonus (task.style_bonus, 1.0) favours (10% -> most of the responses), the drift a frozen
    # drafter does not follow (BENCHMARKS.md, "Drift"). At 6 steps and lr 3e-5 the frozen drafter moved by under 1%.
    steps: int = 10
    workers: int = 4
    mode: Mode = "cotrained"
    seed: int = 0
    prompts_per_step: int = 16
    group_size: int = 4
    policy: str = "deep"
    lr: float = 1e-4
    kl_coef: float = 0.0  # GRPO's KL penalty against the initial policy (tailspec/rl.py: grpo_step)
    temperature: float = 1.0
    max_tokens: int = 512
    max_seq_len: int = 640
    k: int = 4
    # How requests are dealt to workers:
    # - chunk: contiguous blocks of the prompt-major batch (each prompt's whole group on one worker), as verl
    #   and OpenRLHF split a step's batch across rollout workers (DataProto.chunk): a worker's load is the
    #   luck of its prompts' lengths, which nobody knows before decoding;
    # - round_robin: request i to worker i mod W: every worker gets samples of every prompt, which evens the
    #   load out (no framework deals a group apart like this);
    # - by_length: blocks of problems sorted by prompt length (≈ step count): the last worker gets the
    #   longest — a guaranteed tail, for tests on policies too small to have one of their own.
    deal: Literal["chunk", "round_robin", "by_length"] = "chunk"
    bootstrap_samples: int = 256
    # The first drafter's budget: optimizer steps (166: what 60 s gave on a quiet 2-core machine with `deep`), and
    # seconds as a cap only, so a busy machine trains the same drafter as a quiet one (60 s of a machine shared
    # five ways gave 38 steps and an acceptance length of 1.34, a drafter with nothing left to go stale).
    bootstrap_steps: int | None = 166
    bootstrap_seconds: float = 600.0
    validation_samples: int = 32  # held-out samples of a promotion's paired test (trainer.validation_samples)
    # Instrumentation: both drafters' acceptance on this many of a step's samples, every N steps and the last.
    measure_samples: int = 24
    measure_every: int = 2
    run_dir: Path | None = None
    redis_url: str | None = None
    redis_aof: bool = False  # the private redis-server persists to an AOF (fsync every second): restartable
    schedulers: int = 0  # 0: the scheduler is a thread of the demo; n: n scheduler processes, one leads
    max_worker_restarts: int = 3  # a rollout worker that dies is replaced and its share redone, this often
    dashboard: bool = True
    live: bool = True
    export: bool = True
    plots: bool = True
