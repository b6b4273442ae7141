"""The TRL recipe, runnable: GRPO with TRL's `GRPOTrainer` on the built-in running-sum task and a local tiny
policy, with tailspec attached (or not, `--no-tailspec`, for a baseline with the same seed).

    # the scheduler, once per cluster (its sessions read the same shared directory)
    tailspec scheduler run --redis redis://HOST:6379/0 --set cluster.name=grpo \\
        --set trainer.checkpoint_dir=/shared/grpo/drafter
    # the policy, once per machine before the ranks start (a preset is pre-trained on first use: minutes on a CPU)
    python -m tailspec.integrations.trl_example --build-policy
    # the trainer, one process per GPU
    torchrun --nproc_per_node 2 -m tailspec.integrations.trl_example \\
        --redis redis://HOST:6379/0 --cluster grpo --shared-dir /shared/grpo --steps 20

A rank that finds the policy preset missing builds it under the cache's file lock (tailspec.tasks.policy.get_policy:
one rank builds, the others wait and load what it wrote), inside the run; `--build-policy` does it before.
Every rank is one rollout worker on its own GPU. Results go to `--out` as JSON (TRL's log history and what
the attachment did), written by the main process. On CPU (`--cpu`, the default without CUDA) TRL generates
with transformers' `generate`; `--dataset tails` deals prompts so that each step's ranks get problems of very
different lengths (a deterministic long tail, for tests and benches).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tailspec.core.config import TaskConfig
from tailspec.tasks.runsum import Problem, grade, parse_prompt, sample_problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tailspec.integrations.trl_example", description=__doc__.split("\n")[0])
    p.add_argument("--redis", help="tailspec's Redis URL; required unless --no-tailspec")
    p.add_argument("--cluster", default="default", help="tailspec cluster name (Redis key namespace)")
    p.add_argument("--shared-dir", help="absolute directory on a filesystem every node can read: policy versions "
                   "go to <shared-dir>/policy; required unless --no-tailspec")
    p.add_argument("--node", default=None, help="this node's name in the cluster state (the name its GPU telemetry "
                   "uses; default $TAILSPEC_NODE, else the tailspec config's cluster.node)")
    p.add_argument("--no-tailspec", action="store_true", help="plain GRPOTrainer, nothing attached (baseline)")
    p.add_argument("--policy", default="tiny", help="policy preset (built and cached on first use) or directory")
    p.add_argument("--build-policy", action="store_true", help="build and cache the policy preset if it is missing, "
                   "then exit: once, before torchrun starts the ranks")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8, help="completions per rank per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO group size)")
    p.add_argument("--max-completion-length", type=int, default=192)
    p.add_argument("--temperature", type=float, default=1.5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dataset", choices=["task", "tails"], default="task",
                   help="task: the task's own length distribution; tails: short and long problems alternate by rank")
    p.add_argument("--pin-cores", action="store_true", help="pin rank r to simulated GPU r's share of the host's "
                   "cores (scheduler.simulated_gpu_cpus: split), as the demo's rollout workers are")
    p.add_argument("--reclaim-timeout", type=float, default=30.0)
    p.add_argument("--output-dir", default=None, help="TRL's output_dir (default: a temporary directory)")
    p.add_argument("--out", default=None, help="write a JSON summary here (main process)")
    p.add_argument("--stack-dump-after", type=float, default=0.0, metavar="S",
                   help="print every thread's stack to stderr if the run is still going after S seconds "
                        "(0: never); how a hang in a collective shows where it is")
    a = p.parse_args(argv)
    if not a.no_tailspec and not a.build_policy:
        if not a.redis:
            p.error("--redis is required (or --no-tailspec)")
        if not a.shared_dir or not os.path.isabs(a.shared_dir):
            p.error("--shared-dir must be an absolute path on a filesystem shared by every node (or --no-tailspec)")
    for name in ("steps", "batch", "generations", "max_completion_length"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.batch % a.generations:
        p.error(f"--batch ({a.batch}) must be a multiple of --generations ({a.generations})")
    return a


def tokenizer_with_bos(policy_dir: str | Path) -> Any:
    """The task tokenizer with a post-processor that starts every prompt with BOS, as the policy was trained
    (TRL tokenizes prompt text with the processing class)."""
    # deferred: tokenizers / transformers load after the arguments are checked (a wrong flag fails at once)
    from tokenizers.processors import TemplateProcessing

    from tailspec.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(policy_dir)
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)])
    return tok


def build_dataset(kind: str, n: int, seed: int, per_rank_prompts: int, world: int) -> Any:
    """Prompts of the running-sum task. `tails`: for each step, rank 0 gets short problems (2-3 numbers) and the
    other ranks long ones (14-18), in TRL's unshuffled order (rank r takes the r-th slice of each step's batch)."""
    # deferred: `datasets` (pyarrow, seconds) loads after the arguments are checked
    from datasets import Dataset

    task = TaskConfig()
    if kind == "task":
        return Dataset.from_list([{"prompt": p.prompt} for p in sample_problems(n, task, seed=seed)])
    rng = np.random.default_rng(seed)
    rows = []
    while len(rows) < n:
        for rank in range(world):
            for _ in range(per_rank_prompts):
                m = int(rng.integers(2, 4)) if rank == 0 else int(rng.integers(14, 19))
                rows.append({"prompt": Problem(tuple(int(x) for x in rng.integers(0, task.modulus, m)),
                                               task.modulus).prompt})
    return Dataset.from_list(rows[:n])


def runsum_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """TRL reward function: 1.0 for the right final answer of the scratchpad, else 0.0 (the task's grader)."""
    task = TaskConfig()
    return [grade(parse_prompt(p, task.modulus), c, task).reward for p, c in zip(prompts, completions)]


def grpo_config(a: argparse.Namespace) -> Any:
    """The run's `trl.GRPOConfig`."""
    # deferred: as in main, torch and TRL load after the arguments are checked
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=a.output_dir or tempfile.mkdtemp(prefix="tailspec-trl-"), use_cpu=not torch.cuda.is_available(),
        max_steps=a.steps, seed=a.seed, per_device_train_batch_size=a.batch, num_generations=a.generations,
        max_completion_length=a.max_completion_length, temperature=a.temperature, learning_rate=a.lr,
        shuffle_dataset=a.dataset == "task", logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        # TRL's default is bf16 autocast, which a CPU without bf16 instructions emulates: every matmul ~20x slower
        # (a 2-rank step of the tiny policy took 19 s against 2 s), a step no GPU would take. fp32 on the CPU.
        bf16=torch.cuda.is_available(),
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.build_policy:
        # deferred: the policy kit (torch, transformers) loads after the arguments are checked
        from tailspec.tasks.policy import resolve_policy

        print(resolve_policy(a.policy))
        return 0
    if a.stack_dump_after > 0:
        faulthandler.dump_traceback_later(a.stack_dump_after, exit=False)

    # deferred: torch, transformers and TRL load after the arguments are checked and the stack dump is armed
    import torch
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from tailspec.tasks.policy import resolve_policy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if a.pin_cores:
        # deferred: only with --pin-cores
        from tailspec.scheduler.placement import split

        os.sched_setaffinity(0, split(world)[int(os.environ.get("LOCAL_RANK", "0"))])
    policy_dir = resolve_policy(a.policy)
    tok = tokenizer_with_bos(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    per_rank_prompts = a.batch // a.generations
    dataset = build_dataset(a.dataset, max(64, 4 * a.steps * a.batch * world // a.generations), a.seed,
                            per_rank_prompts, world)
    kw = {"model": model, "reward_funcs": runsum_reward, "args": grpo_config(a), "train_dataset": dataset,
          "processing_class": tok}
    attach = None
    if a.no_tailspec:
        trainer = GRPOTrainer(**kw)
    else:
        # deferred: the baseline (--no-tailspec) imports nothing of the attachment
        from tailspec.integrations.trl import TailspecAttach, TailspecGRPOTrainer

        attach = TailspecAttach.connect(a.redis, a.cluster, Path(a.shared_dir) / "policy", node=a.node,
                                        reclaim_timeout_s=a.reclaim_timeout)
        trainer = TailspecGRPOTrainer(**kw, tailspec=attach)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    summary = {"rank": rank, "world": world, "seconds": seconds, "attached": attach is not None,
               "log_history": trainer.state.log_history,
               "tailspec": attach.stats.to_dict() if attach is not None else None}
    if attach is not None:
        attach.close()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # together: a rank that tears gloo down while its peer is still writing its summary can hang or abort
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if a.out:
        path = Path(a.out)
        path = path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        path.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
