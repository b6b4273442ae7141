"""The kit the vLLM bench (benchmarks/vllm.py, vllm_live.py) and the vLLM tests (tests/test_vllm_*.py) share: task
prompts, the policy's own samples, untrained and trained EAGLE-3 drafters exported for vLLM (cached per policy and
training settings), a perturbed next policy version, a broken drafter, the version store's validated acceptance,
and the keyword arguments of a small in-process CPU engine.

Light at import (the CLI's parser imports the bench modules): torch, transformers and the drafter trainer load
inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from tailspec.core.config import TaskConfig, TrainerConfig
from tailspec.core.state import Sample

from tailspec.tasks.runsum import sample_problems

TRAIN_STEPS = 60  # enough training for a clear acceptance gain on the tiny policy, short enough for a CPU


def task_prompts(policy_dir: str | Path, n: int, seed: int = 20_000) -> list[list[int]]:
    # deferred: transformers (the tokenizer); the CLI imports every bench module to build its parser
    from tailspec.tasks.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(policy_dir)
    return [encode_prompt(tok, p.prompt) for p in sample_problems(n, TaskConfig(), seed=seed)]


def policy_samples(policy_dir: str | Path, n: int, seed: int = 0, max_new_tokens: int = 160):
    """The policy's own greedy responses to task prompts, as trainer samples (what the drafter must predict)."""
    # deferred: torch and transformers; the CLI imports every bench module to build its parser
    from tailspec.tasks.policy import generate_responses, load_policy

    model, tok = load_policy(policy_dir)
    prompts = task_prompts(policy_dir, n, seed)
    responses = generate_responses(model, tok, prompts, max_new_tokens, temperature=0.0, seed=seed)
    return [Sample(prompt_ids=p, response_ids=r, reward=1.0, policy_version=0)
            for p, r in zip(prompts, responses) if r]


def make_drafters(policy_dir: str | Path, out: str | Path, train_steps: int = TRAIN_STEPS, n_samples: int = 64,
                  seed: int = 0) -> dict[str, Path]:
    """Untrained and trained EAGLE-3 drafters for the policy, exported for vLLM (eagle3 and hf formats).
    Returns {"untrained", "trained", "trained_hf"} paths; out/training.json records the session."""
    # deferred: torch and the drafter trainer; the CLI imports every bench module to build its parser
    from tailspec.drafter_trainer.export import export
    from tailspec.drafter_trainer.samples import SampleBuffer, fill_buffer
    from tailspec.drafter_trainer.teacher import Teacher
    from tailspec.drafter_trainer.training_session import TrainingSession, new_drafter

    out = Path(out)
    teacher = Teacher.from_dir(policy_dir)
    samples = policy_samples(policy_dir, n_samples, seed, max_new_tokens=128)
    buf = SampleBuffer(capacity=len(samples), holdout_fraction=0.0, mode="uniform")
    vocab = int(teacher.config.vocab_size)
    fill_buffer(buf, samples, vocab, 2048)
    cfg = TrainerConfig(lr=3e-3, batch_size=16, weighting="uniform", seed=seed, checkpoint_dir=str(out / "ckpt"))
    untrained = new_drafter(teacher, cfg, buf)
    export(untrained, out / "untrained", "eagle3")
    session = TrainingSession(cfg, teacher, buf, checkpoint_dir=out / "ckpt")
    t0 = time.perf_counter()
    res = session.run(max_steps=train_steps)
    train_s = time.perf_counter() - t0
    export(session.drafter, out / "trained", "eagle3")
    export(session.drafter, out / "trained_hf", "hf")
    session.close()
    (out / "training.json").write_text(json.dumps({"steps": res.steps, "seconds": train_s,
                                                   "final_loss": res.losses[-1] if res.losses else None}))
    return {"untrained": out / "untrained", "trained": out / "trained", "trained_hf": out / "trained_hf"}


def cached_drafters(policy_dir: str | Path, cache_dir: str | Path | None = None,
                    train_steps: int = TRAIN_STEPS) -> dict[str, Path]:
    """make_drafters once per (policy, training settings), kept under the tailspec cache."""
    # deferred: torch and transformers (tasks.policy imports them); the CLI imports every bench module to
    # build its parser
    from tailspec.tasks.policy import default_cache_dir

    policy_dir = Path(policy_dir)
    h = hashlib.sha256((policy_dir / "model.safetensors").read_bytes()).hexdigest()[:12]
    root = Path(cache_dir or default_cache_dir()) / "vllm-drafters" / f"{policy_dir.name}-{h}-s{train_steps}"
    names = ("untrained", "trained", "trained_hf")
    if not all((root / n / "config.json").is_file() for n in names):
        make_drafters(policy_dir, root, train_steps)
    return {n: root / n for n in names}


def perturbed_policy(policy_dir: str | Path, out: str | Path, scale: float = 0.01, seed: int = 1) -> Path:
    """A copy of the policy directory whose floating-point weights moved by Gaussian noise of `scale` times
    each tensor's own standard deviation: the next policy version of an RL step, for in-place syncs."""
    # deferred: torch would slow `tailspec --help`; the CLI imports every bench module to build its parser
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(policy_dir), Path(out)
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(src / "model.safetensors")
    for name, t in weights.items():
        if t.is_floating_point() and t.numel() > 1:
            weights[name] = (t + scale * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    return out


def zeroed_fc(drafter_dir: str | Path, out: str | Path) -> Path:
    """A copy of an EAGLE-3 export with `fc.weight` and the final `norm.weight` zeroed: the drafter a weight
    sync that wrote zeros leaves behind. It still loads and runs, but its last hidden state is zero, so every
    logit is equal and it drafts the same token whatever the context. (`fc` alone is not enough: the middle
    layer still sees the token embedding, and on the tiny policy's task such a bigram drafter still drafts
    well enough to hide the break.)"""
    # deferred: torch would slow `tailspec --help`; the CLI imports every bench module to build its parser
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(drafter_dir, tmp)
        w = load_file(Path(drafter_dir) / "model.safetensors")
        for name in ("fc.weight", "norm.weight"):
            w[name] = torch.zeros_like(w[name])
        save_file(w, tmp / "model.safetensors", metadata={"format": "pt"})
        tmp.rename(out)
    return out


def validated_acceptance(drafter_dir: str | Path, policy_dir: str | Path, k: int, n: int = 16,
                         temperature: float = 1e-3) -> float:
    """What the version store's validation records for an exported drafter against a policy: expected
    acceptance length at draft length k on the policy's own greedy responses (temperature ~0: greedy
    rollouts accept the argmax only)."""
    # deferred: torch and the drafter trainer; the CLI imports every bench module to build its parser
    from tailspec.drafter_trainer.export import load_export
    from tailspec.drafter_trainer.teacher import Teacher
    from tailspec.drafter_trainer.versions import validate

    drafter = load_export(drafter_dir)
    teacher = Teacher.from_dir(policy_dir, aux_layer_ids=drafter.config.aux_layer_ids)
    drafter.set_target_embedding(teacher.model.get_input_embeddings())
    samples = policy_samples(policy_dir, n, seed=7, max_new_tokens=96)
    return float(validate(drafter, teacher, samples, k=k, temperature=temperature).acceptance_length)


def in_process_engine() -> dict:
    """LLM keyword arguments for a small CPU test engine: engine core and worker in this process (no
    worker process to spawn and connect: the engine starts far sooner on a small CPU machine), a small explicit
    KV cache, no torch.compile."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return {"distributed_executor_backend": "uni", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
                "max_num_batched_tokens": 1024}
