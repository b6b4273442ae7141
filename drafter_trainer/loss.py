"""Test-time-training (TTT) distillation loss and the expected acceptance length.

Index conventions (sequence x_0..x_{n-1}, prompt length P; see model.py's module doc for inference):
- Anchor t: the drafter's step 0 at position t reads the target's aux state g_t and the embedding of
  x_{t+1}, and predicts x_{t+2}. Unroll step i (0-based) of anchor t runs at position t+i, reads the
  drafter's own hidden output of step i-1 and the embedding of x_{t+1+i}, and predicts x_{t+2+i}; its
  target distribution is the teacher's at position t+1+i.
- At inference anchors are m-1 with x_m the newest verified token, m >= P, so only anchors t >= P-1
  are trained, and only predictions of tokens inside the sequence (t+2+i <= n-1; the teacher's
  distribution after EOS is never a target).
- Soft cross-entropy against the teacher's distribution restricted to the draft vocabulary and
  renormalized; per-step weight decay^i; per-sample reward weight w_b:
      L = Σ_i decay^i · Σ_{b,t} w_b·m_{b,i,t}·CE_{b,i,t} / max(1, Σ_{b,t} m_{b,i,t})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tailspec.drafter_trainer.model import Eagle3Module, TTTState


class StopRequested(Exception):
    """Raised inside a step when a stop was requested: the micro-batch in flight is discarded (see
    session.TrainingSession.train_step for what happens to the micro-batches already done)."""


def step_inputs(ids: torch.Tensor, i: int, anchors: int) -> torch.Tensor:
    """x_{t+1+i} for anchors t = 0..anchors-1 (0 where beyond the sequence; such rows are masked)."""
    out = ids.new_zeros(ids.shape[0], anchors)
    src = ids[:, 1 + i : 1 + i + anchors]
    out[:, : src.shape[1]] = src
    return out


def step_targets(logits: torch.Tensor, i: int, anchors: int) -> torch.Tensor:
    out = logits.new_zeros(logits.shape[0], anchors, logits.shape[-1])
    src = logits[:, 1 + i : 1 + i + anchors]
    out[:, : src.shape[1]] = src
    return out


def step_token_counts(lengths: torch.Tensor, prompt_lens: torch.Tensor, steps: int) -> list[float]:
    """Masked positions per unroll step over a batch, i.e. Σ_{b,t} m_{b,i,t} for i = 0..steps-1, from the
    lengths alone (a row of length L and prompt P has max(0, L - P - 1 - i) anchors at step i, whatever its
    padding): the denominators that make micro-batch losses add up to the whole batch's loss."""
    trained = (lengths - prompt_lens - 1).clamp(min=0)
    return [float((trained - i).clamp(min=0).sum()) for i in range(steps)]


def step_mask(lengths: torch.Tensor, prompt_lens: torch.Tensor, i: int, anchors: int) -> torch.Tensor:
    t = torch.arange(anchors, device=lengths.device)[None, :]
    return (t >= prompt_lens[:, None] - 1) & (t + 2 + i <= lengths[:, None] - 1)


def unroll(drafter: Eagle3Module, aux: torch.Tensor, ids: torch.Tensor, steps: int,
           check: Callable[[], None] | None = None, backward_check: Callable[[], None] | None = None):
    """Yield (i, draft_logits [B, A, draft_vocab]) for unroll steps i = 0..steps-1 over anchors 0..A-1. `check` runs
    before each step; `backward_check` (where gradients are taken) runs in the backward pass as it reaches each step,
    and may raise to abandon the backward (the gradients it accumulated so far are then partial)."""
    b, t = ids.shape
    anchors = t - 1
    hidden = drafter.project(aux[:, :anchors])
    state = TTTState()
    base = torch.arange(anchors, device=ids.device).expand(b, anchors)
    for i in range(steps):
        if check is not None:
            check()
        logits, hidden = drafter.ttt_step(hidden, step_inputs(ids, i, anchors), base + i, state)
        if backward_check is not None and hidden.requires_grad:
            hidden.register_hook(_backward_hook(backward_check))
        yield i, logits


def _backward_hook(check: Callable[[], None]) -> Callable[[torch.Tensor], None]:
    def hook(_grad: torch.Tensor) -> None:
        check()  # returns nothing: the gradient passes unchanged

    return hook


@dataclass
class LossOutput:
    loss: torch.Tensor
    step_losses: list[float]
    step_accuracy: list[float]  # top-1 agreement of drafter and teacher (restricted) per step
    tokens: int  # masked (trained) positions at step 0


def soft_ce(draft_logits: torch.Tensor, teacher_logits_draft: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(teacher_logits_draft.float(), dim=-1)
    return -(p * torch.log_softmax(draft_logits.float(), dim=-1)).sum(-1)


def ttt_loss(drafter: Eagle3Module, aux: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor,
             lengths: torch.Tensor, prompt_lens: torch.Tensor, weights: torch.Tensor, steps: int = 3,
             decay: float = 0.8, check: Callable[[], None] | None = None,
             denominators: list[float] | None = None,
             backward_check: Callable[[], None] | None = None) -> LossOutput:
    """The TTT loss of the module doc. `denominators` (step_token_counts of the whole batch) replace this
    batch's own token counts, so the losses of a batch's micro-batches sum to the batch's loss. `check` and
    `backward_check`: `unroll`'s."""
    anchors = ids.shape[1] - 1
    keep = drafter.draft_ids_in_target()
    total = aux.new_zeros((), dtype=torch.float32)
    step_losses, step_acc, tokens = [], [], 0
    w = weights.to(aux.device).float()[:, None]
    for i, logits in unroll(drafter, aux, ids, steps, check, backward_check):
        target = step_targets(teacher_logits, i, anchors)[..., keep]
        m = step_mask(lengths.to(ids.device), prompt_lens.to(ids.device), i, anchors).float()
        n = m.sum()
        ce = soft_ce(logits, target)
        denom = n.clamp(min=1.0) if denominators is None else max(1.0, denominators[i])
        li = (w * m * ce).sum() / denom
        total = total + (decay ** i) * li
        step_losses.append(float(li.detach()))
        agree = (logits.argmax(-1) == target.argmax(-1)).float()
        step_acc.append(float((agree * m).sum() / n.clamp(min=1.0)))
        if i == 0:
            tokens = int(n)
    return LossOutput(total, step_losses, step_acc, tokens)


@torch.no_grad()
def acceptance_rates(drafter: Eagle3Module, aux: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor,
                     lengths: torch.Tensor, prompt_lens: torch.Tensor, k: int,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor acceptance probabilities α_1..α_k of speculative sampling along the recorded path:
    α_i = Σ_x min(p_i(x), q_i(x)) with p the teacher's and q the drafter's distribution over the full
    vocabulary (q is 0 outside the draft vocabulary). → (alpha [B, A, k], valid [B, A]); an anchor is
    valid when all k of its steps predict tokens inside the response."""
    anchors = ids.shape[1] - 1
    alphas = []
    for i, logits in unroll(drafter, aux, ids, k):
        q = drafter.target_probs(logits, temperature)
        p = torch.softmax(step_targets(teacher_logits, i, anchors).float() / max(temperature, 1e-6), dim=-1)
        alphas.append(torch.minimum(p, q).sum(-1))
    valid = step_mask(lengths.to(ids.device), prompt_lens.to(ids.device), k - 1, anchors)
    return torch.stack(alphas, dim=-1), valid


@torch.no_grad()
def rank_acceptance_rates(drafter: Eagle3Module, aux: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor,
                          lengths: torch.Tensor, prompt_lens: torch.Tensor, depth: int, ranks: int,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor rates of a token tree's nodes along the recorded path, the accept(d, r) of
    rollout.strategy.expected_accepted: P(the drafter's rank-r child at depth d is the accepted one | its parent
    was). Rank 0 is acceptance_rates' α_d = Σ_x min(p_d(x), q_d(x)); rank r >= 1 is p_d(x_r), the teacher's
    probability of the drafter's (r+1)-th most probable token (the chance the target's token is that sibling),
    0 where the draft vocabulary has fewer tokens. → (rates [B, A, depth, ranks], valid [B, A]); an anchor is
    valid when all `depth` of its steps predict tokens inside the response."""
    anchors = ids.shape[1] - 1
    keep = drafter.draft_ids_in_target()
    siblings = max(0, min(ranks, keep.numel()) - 1)
    steps = []
    for i, logits in unroll(drafter, aux, ids, depth):
        q = drafter.target_probs(logits, temperature)
        p = torch.softmax(step_targets(teacher_logits, i, anchors).float() / max(temperature, 1e-6), dim=-1)
        rates = p.new_zeros(*p.shape[:-1], ranks)
        rates[..., 0] = torch.minimum(p, q).sum(-1)
        if siblings:
            top = logits.topk(siblings + 1, dim=-1).indices[..., 1:]  # draft ids of ranks 1..siblings
            rates[..., 1 : siblings + 1] = p.gather(-1, keep[top])
        steps.append(rates)
    valid = step_mask(lengths.to(ids.device), prompt_lens.to(ids.device), depth - 1, anchors)
    return torch.stack(steps, dim=-2), valid


def expected_length(alpha: torch.Tensor) -> torch.Tensor:
    """E = Σ_{i=0..k} Π_{j<=i} α_j with α_0 = 1: tokens per target forward for chain length k."""
    return 1.0 + torch.cumprod(alpha, dim=-1).sum(-1)
