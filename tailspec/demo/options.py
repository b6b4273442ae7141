"""The demo's options (what `tailspec demo` flags set) and the session settings it applies, apart from the run so
that building the CLI's parser imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Mode = Literal["cotrained", "frozen", "nospec"]


@dataclass
class DemoOptions:
    # 10 steps at lr 1e-4: enough for GRPO to move the deep policy from its main scratchpad style toward the one
    # the reward's style bonus (task.style_bonus) favours, the drift a frozen drafter does not follow; fewer steps
    # at a lower lr leave the policy where the frozen drafter still fits it.
    steps: int = 10
    workers: int = 4
    mode: Mode = "cotrained"
    seed: int = 0
    prompts_per_step: int = 16
    group_size: int = 4
    policy: str = "deep"  # the CPU's main job; `--device cuda` defaults to GPU_POLICY (policy_for)
    # auto: CUDA where torch sees a device, else the CPU; cuda: the simulated GPUs are CUDA devices or shares of
    # them (tailspec/demo/device_share.py), the RL update and the first drafter run there too
    device: str = "auto"
    mps: bool = True  # shares of one device under CUDA MPS where it can be started (else time-sliced)
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
    # The first drafter's budget: optimizer steps (few, since the user waits for them before the first RL step),
    # and seconds as a cap only, so a busy machine trains the same drafter as a quiet one: a time budget would
    # leave a busy machine a drafter too weak to go stale, and the run nothing to show.
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
    # Each worker's warm-up cost table, {worker name: CostModel.to_dict()} (a run.json's `cost_models`): the workers
    # still run their warm-up steps but start from these tables instead of their own timings. bench e2e gives the
    # co-trained mode the frozen mode's tables: both run on the same simulated GPUs, and one table keeps the two
    # selectors' choices paired where separate timings would differ by the machine's noise.
    cost_tables: dict[str, dict] | None = None
    max_worker_restarts: int = 3  # a rollout worker that dies is replaced and its share redone, this often
    dashboard: bool = True
    live: bool = True
    export: bool = True
    plots: bool = True


GPU_POLICY = "gpu"  # the policy preset sized for a GPU (tailspec/tasks/policy.py)


def policy_for(policy: str | None, device: str) -> str:
    """The policy a run uses: the one named, else the device's main job (`gpu` on `--device cuda`, `deep`
    elsewhere: `auto` keeps the CPU's, so `make demo` is the same run on any machine)."""
    return policy or (GPU_POLICY if device == "cuda" else DemoOptions.policy)


# The demo's session settings (also the cotrain bench's), where the user's config does not set them:
# - batch_size ≤ 8 in micro-batches of 2: a lend is often shorter than a step, and a revoked step keeps the
#   micro-batches it finished (drafter_trainer/training_session.py: Stopping);
# - validate every 5 s: tails are seconds long;
# - merge every 2 steps (a merge is a small fraction of a step): a session killed past its deadline loses at most
#   one step, and contributors see each other's work 2 steps late (the later they see it, the lower the acceptance);
# - propose a head once it holds 12 more steps than the last one proposed: a paired validation outlasts most
#   lends, so proposing every head would spend the lent time validating, and a head of a few steps is too little
#   trained to pass;
# - lr 2e-4: sessions fine-tune the bootstrap drafter (trained offline at bootstrap_lr 6e-4) with three or four
#   contributors at once, and at the bootstrap's lr their merged deltas make the lineage worse than its start;
# - hold out a quarter of the samples: a session validates on its buffer's held-out share of ~2 policy
#   versions' 64 samples each, and a smaller share falls below the paired test's 16; training is short of
#   seconds, not of samples;
# - synchronous rounds (drafter_trainer/rounds.py): the contributors' gradients make one step a round, which
#   asynchronous contributors' merged deltas fall short of. Their exchange is files on the lineage's filesystem,
#   sized for the miniature's drafters, so the library default stays `async`.
DEMO_TRAINER = {"batch_size": 8, "micro_batch_size": 2, "validate_every_s": 5.0, "merge_every_steps": 2,
                "holdout_fraction": 0.25, "propose_min_steps": 12, "lr": 2e-4, "bootstrap_lr": 6e-4,
                "merge_rule": "rounds"}
# Lend when the expected tail exceeds this (scheduler.session_startup_s; see Demo.config).
DEMO_SESSION_STARTUP_S = 0.3


def apply_demo_trainer(tc, validation_samples: int | None = None) -> None:
    """DEMO_TRAINER into a TrainerConfig, except where the user set a value (batch_size: at most 8); and the
    run's `validation_samples` when given (the demo's DemoOptions.validation_samples)."""
    for k, v in DEMO_TRAINER.items():
        if k not in tc.model_fields_set:
            setattr(tc, k, v if k != "batch_size" else min(tc.batch_size, v))
    if validation_samples is not None:
        tc.validation_samples = validation_samples
