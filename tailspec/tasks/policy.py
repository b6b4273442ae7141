"""Tiny-policy kit: build a Llama-architecture `LlamaForCausalLM` from a config, pre-train it by
supervised learning on gold traces of the task, cache it, and load it back with `from_pretrained`
(the same code path a real checkpoint takes).

Presets:
- `micro` (~0.1M params, 2 layers): for unit tests; trains in seconds.
- `micro4` (~0.15M params, 4 layers): for tests that export a servable EAGLE-3 drafter.
- `tiny`  (~3.4M params, ≤ 5M): for CPU tests and benchmarks; trains in ≤ 3 min on 2 cores.
- `small` (~60M params): for GPU benchmarks (bf16); trains on a GPU in minutes, on a CPU in hours.
- `deep`  (~3.0M params, 20 layers at hidden size 128, 4 heads / 2 KV heads, MLP 256): the demo's policy, a
  miniature with a GPU deployment's cost ratios. An EAGLE-3 drafter is one decoder layer at the target's hidden
  size; beside the 4-layer `tiny` it costs ~0.39 of a target forward (speculation can hardly pay), beside these
  20 layers under a tenth (`tailspec bench engine --policy deep` times it), as an EAGLE-3 layer beside a
  28-64-layer model on a GPU. Pre-training: 300 steps on short problems (<= 6 numbers) then 300 on the task's
  distribution, with a scaled residual init and the lr decayed to 0. 10% of its corpus is written
  in the task's alternative scratchpad style (`Preset.alt_style_rate`; tailspec/tasks/runsum.py), so it writes
  that style about as often, and the reward's style bonus gives GRPO a drift to follow; the others see only the
  main style. `tailspec bench task` reports its accuracy, tail and training time.
- `gpu`   (~0.87B params, 16 layers at hidden size 2048, 16 heads / 4 KV heads of 128, MLP 7168): the main job's
  policy on a GPU (`--device cuda`). `deep` is 5.9 MB of weights, so on an H100 its decode step is launch-bound,
  hundreds of times its HBM floor; this preset's 1.74 GB of bf16 weights take about as long to read as its 16 layers'
  kernels take to run when replayed, so the batch-1 decode step is memory-bound, as the rollouts of RL policies are,
  while an EAGLE-3 layer stays ~1/16 of a target forward (`bench engine --hbm-floor` measures the ratio). It pre-trains in bf16
  autocast on the device (800 steps); on a CPU it builds and decodes too, slowly, and is never a CPU default.

The training budget is chosen so the policy is imperfect on purpose (accuracy between 20% and 80% at
temperature 1.0): RL then has something to improve and the policy keeps moving during RL, which is
what makes a frozen drafter go stale.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tailspec.core.atomic import file_lock, write_dir_atomic
from tailspec.core.config import TaskConfig
from tailspec.tasks.runsum import ALT, MAIN, Problem, grade, sample_problems
from tailspec.tasks.tokenizer import (
    build_tokenizer,
    decode_response,
    encode_prompt,
    load_tokenizer,
    save_tokenizer,
)

KIT_VERSION = 3  # bump to invalidate every cached policy when training code changes


@dataclass(frozen=True)
class Preset:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position: int = 1024  # longest prompt + response of the task is ~530 tokens
    train_steps: int = 300
    batch_size: int = 32
    lr: float = 2e-3
    seed: int = 0
    # GPT-2-style init of the layers' residual outputs (o_proj, down_proj): std = initializer_range /
    # sqrt(2 * layers), so the residual stream of a deep stack starts near the embeddings and forms the copy of
    # the previous total sooner (see `deep` below).
    scaled_residual_init: bool = False
    # A curriculum: the first `short_steps` of the train_steps see only problems of at most `short_numbers`
    # numbers (cheap, and where the copy / lookup / add mechanisms form), the rest the task's distribution.
    short_steps: int = 0
    short_numbers: int = 6
    # Share of the corpus written in the task's alternative scratchpad style (tailspec/tasks/runsum.py), drawn
    # per problem; `task.alt_style_rate` overrides it. The reward's style bonus makes GRPO move toward it.
    alt_style_rate: float = 0.0
    # The cosine schedule's floor, a share of lr. `deep` decays to 0: at a tenth of its lr the last steps still
    # move it more than its remaining errors (single sums and look-ups) allow it to settle.
    lr_floor: float = 0.1
    # Build (pre-train) on CUDA where there is one when the caller names no device: a preset sized for a GPU
    # would take hours on the host's CPU.
    prefer_cuda: bool = False


# Fields added after the first presets were cached: left out of the cache key at their defaults, so adding
# one does not rebuild every cached policy (the key of a preset that sets it changes, as it must).
_KEY_OPTIONAL_DEFAULTS = {"scaled_residual_init": False, "short_steps": 0, "short_numbers": 6, "alt_style_rate": 0.0,
                          "lr_floor": 0.1, "prefer_cuda": False}
# Task fields that do not change the corpus (the reward's style bonus) or enter the key through the preset's
# fields (alt_style_rate: the rate in effect): left out of the task part of the key.
_KEY_TASK_EXCLUDED = {"alt_style_rate", "style_bonus"}


PRESETS: dict[str, Preset] = {
    "micro": Preset("micro", 64, 2, 2, 1, 128, train_steps=60, batch_size=16, lr=3e-3),
    # 4 layers: the smallest target whose EAGLE-3 aux layers (1, 2, 3) vLLM / SGLang can serve
    "micro4": Preset("micro4", 64, 4, 2, 1, 128, train_steps=60, batch_size=16, lr=3e-3),
    # lr 1e-3: from 2e-3 up the 4-layer model never learns to copy the previous total (it stays at chance on
    # every computed digit); at 1e-3 it learns the tag lookup within its training steps.
    "tiny": Preset("tiny", 256, 4, 4, 2, 768, train_steps=500, batch_size=24, lr=1e-3),
    "small": Preset("small", 768, 8, 12, 4, 2304, train_steps=1500, batch_size=64, lr=6e-4),
    # deep and narrow: a GPU deployment's cost ratios (see the module docstring). The curriculum: on the task's
    # distribution alone the copy of the previous total forms late and leaves too few steps for the rest; on
    # short problems it forms early. lr 1e-3: a higher one leaves it less accurate.
    # 10% of its corpus in the alternative style: what the demo's reward bonus shifts it toward (the drift).
    "deep": Preset("deep", 128, 20, 4, 2, 256, train_steps=600, batch_size=24, lr=1e-3, scaled_residual_init=True,
                   short_steps=300, short_numbers=6, alt_style_rate=0.1, lr_floor=0.0),
    # wide enough that a decode step reads its weights for longer than its kernels take to launch (module
    # docstring); deep's curriculum, residual init and alternative style, at the lower lr a wider model needs
    "gpu": Preset("gpu", 2048, 16, 16, 4, 7168, train_steps=800, batch_size=32, lr=3e-4, scaled_residual_init=True,
                  short_steps=300, short_numbers=6, alt_style_rate=0.1, lr_floor=0.0, prefer_cuda=True),
}


def alt_style_rate(preset: Preset, task: TaskConfig) -> float:
    """The share of the corpus in the alternative style: the task's `alt_style_rate` where set, else the preset's."""
    return preset.alt_style_rate if task.alt_style_rate is None else task.alt_style_rate


def model_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(preset: Preset | str, tokenizer: PreTrainedTokenizerFast | None = None) -> LlamaForCausalLM:
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    tokenizer = tokenizer or build_tokenizer()
    torch.manual_seed(preset.seed)
    cfg = model_config(preset, tokenizer)
    model = LlamaForCausalLM(cfg)
    if preset.scaled_residual_init:
        std = cfg.initializer_range / math.sqrt(2 * preset.num_layers)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.normal_(0.0, std)
                layer.mlp.down_proj.weight.normal_(0.0, std)
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def cache_key(preset: Preset, task: TaskConfig) -> str:
    """What the cached policy depends on: the kit, the preset's fields (the alternative style's rate in effect)
    and the task's fields that shape the corpus."""
    fields = {**asdict(preset), "alt_style_rate": alt_style_rate(preset, task)}
    fields = {k: v for k, v in fields.items() if k not in _KEY_OPTIONAL_DEFAULTS or v != _KEY_OPTIONAL_DEFAULTS[k]}
    blob = json.dumps({"kit": KIT_VERSION, "preset": fields, "task": task.model_dump(exclude=_KEY_TASK_EXCLUDED)},
                      sort_keys=True)
    return f"{preset.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def default_cache_dir() -> Path:
    return Path(os.environ.get("TAILSPEC_CACHE", Path.home() / ".cache" / "tailspec"))


def _batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem], alt: list[bool] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels; loss only on the response (and its EOS). `alt[i]`: problem i's gold
    response in the alternative scratchpad style."""
    seqs, labels = [], []
    for i, p in enumerate(problems):
        prompt = encode_prompt(tokenizer, p.prompt)
        gold = p.gold_in(ALT if alt is not None and alt[i] else MAIN)
        resp = tokenizer.encode(gold, add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(prompt + resp)
        labels.append([-100] * len(prompt) + resp)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, lab


@dataclass
class TrainReport:
    steps: int
    seconds: float
    final_loss: float
    losses: list[float] = field(default_factory=list)


def pretrain(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    preset: Preset,
    task: TaskConfig,
    progress: bool = True,
) -> TrainReport:
    """Supervised pre-training on gold traces (AdamW, warm-up + cosine decay to `preset.lr_floor` x lr)."""
    torch.manual_seed(preset.seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, preset.train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        cos = 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, preset.train_steps - warm)))
        return preset.lr_floor + (1 - preset.lr_floor) * cos

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    batches = _pretrain_batches(preset, task)
    rate = alt_style_rate(preset, task)
    style_rng = np.random.default_rng(preset.seed + 2)  # which problems are written in the alternative style
    model.train()
    losses: list[float] = []
    # bf16 autocast on CUDA (fp32 master weights and optimizer): the `gpu` preset's minutes; a CPU trains in fp32
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    t0 = time.perf_counter()
    bar = tqdm(range(preset.train_steps), desc=f"pretrain {preset.name}", disable=not progress, leave=False)
    for step in bar:
        alt = list(style_rng.random(len(batches[step])) < rate) if rate > 0 else None
        ids, lab = _batch(tokenizer, batches[step], alt)
        with autocast:
            out = model(input_ids=ids.to(device), labels=lab.to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return TrainReport(preset.train_steps, time.perf_counter() - t0, losses[-1], losses)


def _pretrain_batches(preset: Preset, task: TaskConfig) -> list[list[Problem]]:
    """The pre-training batches in order: the short-problem warm-up batches first, then the rest."""
    if not 0 <= preset.short_steps < preset.train_steps:
        raise ValueError(f"short_steps must be in [0, train_steps={preset.train_steps}), got {preset.short_steps}")
    if preset.short_steps and preset.short_numbers < task.steps_min:
        raise ValueError(f"short_numbers={preset.short_numbers} is below the task's steps_min={task.steps_min}")
    bs = preset.batch_size
    # Training problems use seeds disjoint from evaluation (seed 10_000+) so accuracy is held out.
    problems = sample_problems((preset.train_steps - preset.short_steps) * bs, task, seed=preset.seed + 1)
    # Length-bucketed batches: the heavy tail would otherwise pad most rows to the longest one (~3x
    # wasted compute); the order of buckets is shuffled so training sees every length throughout.
    problems.sort(key=lambda q: len(q.numbers))
    batches = [problems[i : i + bs] for i in range(0, len(problems), bs)]
    np.random.default_rng(preset.seed).shuffle(batches)
    if preset.short_steps:
        need, short, draw = preset.short_steps * bs, [], 0
        while len(short) < need:  # the task's own problems, the short ones kept (a seed per draw of 4096)
            draw += 1
            short += [q for q in sample_problems(4096, task, seed=preset.seed + 1000 + draw)
                      if len(q.numbers) <= preset.short_numbers]
        short = short[:need]
        short.sort(key=lambda q: len(q.numbers))
        first = [short[i : i + bs] for i in range(0, need, bs)]
        np.random.default_rng(preset.seed + 1).shuffle(first)
        batches = first + batches
    return batches


@dataclass
class EvalReport:
    n: int
    accuracy: float
    well_formed: float
    len_p50: float
    len_p90: float
    len_p99: float
    gold_len_p50: float
    gold_len_p99: float
    lengths: list[int]
    alt_style: float = 0.0  # share of the responses well-formed in the alternative scratchpad style

    @property
    def tail_ratio(self) -> float:
        return self.len_p99 / max(self.len_p50, 1e-9)


@torch.no_grad()
def generate_responses(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> list[list[int]]:
    """HF `generate` (left-padded batches); returns response ids up to and including EOS."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    out: list[list[int]] = []
    # Sort by length so batches pad little; restore order at the end.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: dict[int, list[int]] = {}
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        gen = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        for r, i in enumerate(idx):
            resp = gen[r, width:].tolist()
            if tokenizer.eos_token_id in resp:
                resp = resp[: resp.index(tokenizer.eos_token_id) + 1]
            else:
                resp = [t for t in resp if t != tokenizer.pad_token_id]
            results[i] = resp
    out = [results[i] for i in range(len(prompts))]
    return out


def evaluate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    task: TaskConfig | None = None,
    n: int = 256,
    temperature: float = 1.0,
    seed: int = 10_000,
) -> EvalReport:
    task = task or TaskConfig()
    problems = sample_problems(n, task, seed=seed)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    max_new = max(len(p.gold) for p in problems) + 16
    responses = generate_responses(model, tokenizer, prompts, max_new, temperature=temperature, seed=seed)
    graded = [grade(p, decode_response(tokenizer, r), task) for p, r in zip(problems, responses)]
    lengths = [len(r) for r in responses]
    gold = [len(p.gold) + 1 for p in problems]
    pct = lambda xs, q: float(np.percentile(xs, q))  # noqa: E731
    return EvalReport(
        n=n,
        accuracy=float(np.mean([g.correct for g in graded])),
        well_formed=float(np.mean([g.well_formed for g in graded])),
        len_p50=pct(lengths, 50), len_p90=pct(lengths, 90), len_p99=pct(lengths, 99),
        gold_len_p50=pct(gold, 50), gold_len_p99=pct(gold, 99),
        lengths=lengths, alt_style=float(np.mean([g.style == ALT for g in graded])),
    )


def save_policy(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path, meta: dict) -> None:
    """The cache entry is written whole or not at all (write_dir_atomic)."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)
        (tmp / "tailspec_policy.json").write_text(json.dumps(meta, indent=2))

    write_dir_atomic(Path(path), write)


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load a policy directory through the real HF path (`AutoModelForCausalLM.from_pretrained`)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a policy directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model, load_tokenizer(path)


def policy_meta(path: str | Path) -> dict:
    f = Path(path) / "tailspec_policy.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def resolve_policy(spec: str | Path, task: TaskConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """A policy directory as given, or a preset name → its cached (built on first use) directory."""
    if str(spec) in PRESETS and not Path(spec).exists():
        return get_policy(str(spec), task, cache_dir=cache_dir)
    if not (Path(spec) / "config.json").is_file():
        raise ValueError(f"policy {str(spec)!r} is neither a policy directory (with config.json) nor a preset "
                         f"({', '.join(PRESETS)})")
    return Path(spec)


def cached_policy(spec: str | Path, task: TaskConfig | None = None, cache_dir: str | Path | None = None) -> Path | None:
    """The policy directory `spec` names if it is there already (a directory as given, a preset once pre-trained
    and cached), without building anything; None otherwise."""
    if str(spec) in PRESETS and not Path(spec).exists():
        path = _preset_dir(PRESETS[str(spec)], task or TaskConfig(), cache_dir)
        return path if _built(path) else None
    return Path(spec) if (Path(spec) / "config.json").is_file() else None


def _preset_dir(preset: Preset, task: TaskConfig, cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "policies" / cache_key(preset, task)


def _built(path: Path) -> bool:
    """A cached preset's directory holds both its model and its metadata (what get_policy returns as built)."""
    return (path / "config.json").is_file() and (path / "tailspec_policy.json").is_file()


def get_policy(
    preset: str = "tiny",
    task: TaskConfig | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    device: str | None = None,
    eval_n: int = 256,
) -> Path:
    """Path of the cached, pre-trained policy for `preset`, building and training it on first use (on `device`;
    None: the CPU, or CUDA where there is one for a preset that prefers it)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown policy preset {preset!r}; choose from {', '.join(PRESETS)}")
    task = task or TaskConfig()
    p = PRESETS[preset]
    path = _preset_dir(p, task, cache_dir)
    if _built(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Processes that start together on a cold cache (torchrun's ranks, a demo's workers) build the policy once:
    # the first takes the lock and builds, the others wait for it and find the entry built.
    # The lock file goes once the entry is built: later callers find the entry and never take the lock.
    lock = path.parent / f".{path.name}.lock"
    with file_lock(lock):
        if not _built(path):
            _build_policy(p, task, path, progress, device, eval_n)
        lock.unlink(missing_ok=True)
    return path


def _build_policy(p: Preset, task: TaskConfig, path: Path, progress: bool, device: str | None, eval_n: int) -> Path:
    if device is None and p.prefer_cuda and torch.cuda.is_available():
        device = "cuda"
    tokenizer = build_tokenizer()
    model = build_model(p, tokenizer)
    if device:
        model.to(device)
    report = pretrain(model, tokenizer, p, task, progress=progress)
    ev = evaluate(model, tokenizer, task, n=eval_n)
    model.to("cpu")
    meta = {
        "preset": p.name, "params": count_params(model), "train_seconds": report.seconds,
        "train_steps": report.steps, "final_loss": report.final_loss, "accuracy": ev.accuracy,
        "well_formed": ev.well_formed, "alt_style": ev.alt_style, "alt_style_rate": alt_style_rate(p, task),
        "len_p50": ev.len_p50, "len_p90": ev.len_p90, "len_p99": ev.len_p99,
        "task": task.model_dump(), "kit_version": KIT_VERSION, "created_at": time.time(),
    }
    save_policy(model, tokenizer, path, meta)
    return path
