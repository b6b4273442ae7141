"""Shared fixtures' builders for the engine tests (not a test module)."""

from __future__ import annotations

import torch

from tailspec.tasks.policy import build_model, get_policy, load_policy
from tailspec.tasks.runsum import sample_problems
from tailspec.tasks.tokenizer import build_tokenizer, encode_prompt


def micro_policy():
    """The trained `micro` policy (cached after the first build, ~20 s) and its tokenizer."""
    return load_policy(get_policy("micro", progress=False))


def random_micro(seed: int = 1):
    torch.manual_seed(seed)
    return build_model("micro").eval()


def noisy_copy(model, scale: float = 0.5, seed: int = 3):
    """The policy with Gaussian noise (scale x each tensor's std) on every weight: a drafter that is right
    often but not always, so both branches of the acceptance rule run on most steps."""
    import copy

    torch.manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * p.std() * scale)
    return m


def task_prompts(n: int, seed: int = 5) -> list[list[int]]:
    tok = build_tokenizer()
    return [encode_prompt(tok, p.prompt) for p in sample_problems(n, seed=seed)]


def random_eagle3(target, draft_vocab_size: int = 16, seed: int = 0):
    """A random-init EAGLE-3 head over a non-identity draft vocabulary (exercises d2t)."""
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module, vocab_maps_from_counts

    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab_size)
    d = Eagle3Module(cfg, target.get_input_embeddings()).eval()
    counts = torch.rand(target.config.vocab_size)
    d.set_vocab_maps(*vocab_maps_from_counts(counts, draft_vocab_size))
    return d


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | list[int] = 2, pad: int = 0) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad,
    )
    return out[0, len(prompt):].tolist()
