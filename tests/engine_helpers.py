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


def distilled_eagle3(target, sequences: list[list[int]], draft_vocab_size: int | None = None, steps: int = 100,
                     ttt_steps: int = 3, lr: float = 1e-2, seed: int = 0):
    """An EAGLE-3 head fit to `target` by a short TTT distillation (drafter_trainer.loss.ttt_loss, the trainer's
    own loss) on `sequences` (token lists, any lengths; every anchor trained, the first included, since the
    engine's first draft comes from the prefill's last pair): a drafter that accepts often, so the speculative
    paths are exercised. A draft vocabulary smaller than the target's keeps the most frequent ids of the
    sequences (exercises d2t). Returns (drafter, the last step's per-unroll-step top-1 agreement)."""
    from tailspec.drafter_trainer.loss import ttt_loss
    from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module, capture_aux, vocab_maps_from_counts

    torch.manual_seed(seed)
    vocab = int(target.config.vocab_size)
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab_size or vocab)
    d = Eagle3Module(cfg, target.get_input_embeddings())
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    if cfg.draft_vocab_size < vocab:
        counts = torch.bincount(torch.cat([torch.tensor(s) for s in sequences]), minlength=vocab).double()
        d.set_vocab_maps(*vocab_maps_from_counts(counts, cfg.draft_vocab_size))
    with torch.no_grad(), capture_aux(target, cfg.aux_layer_ids) as got:
        teacher = target(ids).logits
    aux = got[0]
    ones = torch.ones(len(sequences))
    opt = torch.optim.AdamW(d.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        out = ttt_loss(d, aux, teacher, ids, lengths, torch.ones_like(lengths), ones, steps=ttt_steps)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return d.eval(), out.step_accuracy
