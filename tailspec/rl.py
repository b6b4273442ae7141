"""A real, minimal GRPO step: the demo's stand-in for the user's RL framework (verl, OpenRLHF, NeMo-RL).

Groups of responses per prompt, group-normalized advantages, and a clipped policy-gradient step whose
old log-probabilities are the rollout engine's own (RL needs the policy's own logprobs; the engine is
lossless, so they are the policy's). It talks to tailspec only through the client calls, as an RL
framework would.

One distribution on both sides of the ratio: the rollout sampled from the policy at temperature T, so the
old logprobs are that distribution's (the engine's `sampling_logprobs`, not its raw T = 1 `logprobs`), and
`grpo_step` / `recompute_logprobs` evaluate the policy at the same T (logits / T, as verl and OpenRLHF do).
At T = 1 the two kinds of engine logprobs coincide; at T != 1 mixing them makes the ratio of an unchanged
policy differ from 1 and the clip cut gradients it should not.

An optional KL penalty against a frozen reference policy (`kl_coef`, `ref_model`), as GRPO has it: the k3
estimator per response token, KL ~ exp(ref - new) - (ref - new) - 1 (unbiased for KL(new || ref) on the
policy's own samples, always >= 0, zero with its gradient where new = ref), averaged over tokens like the
clipped objective and added to the loss times `kl_coef`. It keeps a larger learning rate from running away
from a working policy. `kl_coef` = 0 (the default) is the plain clipped objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tailspec.core.atomic import write_dir_atomic


@dataclass
class Rollout:
    """One response: ids, the rollout's per-token logprobs of the emitted tokens, reward, group.

    `logprobs` are those of the distribution the tokens were sampled from: the policy at the rollout's
    temperature (the engine's `RequestOutput.sampling_logprobs`). Top-k / top-p truncation is not modelled by
    `grpo_step`: roll out without it."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    reward: float
    group: int


def group_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: (r − mean of the group) / (std of the group + eps); a group where every reward is equal
    carries no signal and gets advantage 0."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for g in np.unique(groups):
        m = groups == g
        r = rewards[m]
        adv[m] = (r - r.mean()) / (r.std() + eps) if r.std() > 0 else 0.0
    return adv


def _pad(rollouts: list[Rollout], pad_id: int, device: torch.device | str = "cpu"
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] ids, attention mask, response mask (positions whose NEXT token is a response
    token), and old logprobs aligned to those positions, on `device` (the policy's)."""
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width - 1), dtype=torch.bool)
    old = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
    for i, (r, s) in enumerate(zip(rollouts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        p, n = len(r.prompt_ids), len(r.response_ids)
        resp[i, p - 1 : p - 1 + n] = True
        old[i, p - 1 : p - 1 + n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return ids.to(device), attn.to(device), resp.to(device), old.to(device)


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p_T(token t+1 | ≤ t) for every position of right-padded sequences, [B, T-1], where p_T is the
    policy at `temperature` (softmax of logits / T): the distribution a rollout at that temperature samples."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (a greedy rollout has no sampling distribution), got {temperature!r}")
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, -1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, rollouts: list[Rollout], pad_id: int, temperature: float = 1.0) -> list[list[float]]:
    """A plain forward over the same tokens at `temperature`: the reference the rollout's (sampling)
    logprobs must equal, for a rollout sampled at that temperature."""
    ids, attn, resp, _ = _pad(rollouts, pad_id, _device(model))
    lp = token_logprobs(model, ids, attn, temperature)
    return [lp[i][resp[i]].tolist() for i in range(len(rollouts))]


@torch.no_grad()
def policy_drift(model: torch.nn.Module, rollouts: list[Rollout], prev: list[Rollout] | None, pad_id: int,
                 temperature: float = 1.0) -> tuple[float, float | None]:
    """The policy's entropy and its move since an earlier step, at the rollout's temperature:
    - the mean entropy (nats) of the policy's next-token distribution over `rollouts`' response positions (its own
      samples, so the entropy its rollouts see);
    - the k3 estimate of KL(earlier policy || policy) over `prev`'s response tokens: they were sampled by the
      earlier policy, whose logprobs they carry (`Rollout.logprobs`), so with r = p_now / p_then per token,
      r - 1 - log r is unbiased for that KL and never negative. None without `prev`.
    Both come from plain forwards of the policy as it is now (one over each list)."""
    device = _device(model)
    ids, attn, resp, _ = _pad(rollouts, pad_id, device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    lsm = F.log_softmax(logits, -1)
    ent = -(lsm.exp() * lsm).sum(-1)
    entropy = float(ent[resp].mean()) if bool(resp.any()) else 0.0
    if not prev:
        return entropy, None
    ids, attn, resp, old = _pad(prev, pad_id, device)
    log_r = torch.where(resp, token_logprobs(model, ids, attn, temperature) - old, torch.zeros_like(old))
    k3 = (torch.exp(log_r) - 1 - log_r)[resp]
    return entropy, float(k3.mean()) if k3.numel() else None


@dataclass
class StepStats:
    loss: float
    mean_reward: float
    clip_fraction: float
    mean_abs_advantage: float
    tokens: int
    kl: float = 0.0  # mean k3 estimate of KL(policy || reference) over the trained tokens (0 without kl_coef)


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: list[Rollout],
    pad_id: int,
    clip_eps: float = 0.2,
    minibatch: int = 32,
    temperature: float = 1.0,
    max_grad_norm: float = 1.0,
    kl_coef: float = 0.0,
    ref_model: torch.nn.Module | None = None,
    micro_batch: int | None = 8,
) -> StepStats:
    """One GRPO update over `rollouts` (one pass, minibatches; token-level mean of the clipped objective).

    `temperature` is the rollout's: the ratio is p_T,new / p_T,old, both at that temperature, with the old
    logprobs from `Rollout.logprobs` (the sampling distribution's). For an unchanged policy it is 1.

    A minibatch's gradient is accumulated over length-sorted parts of `micro_batch` rollouts (None: the
    minibatch at once); the parts' losses sum to the minibatch's, so the update is the same.

    `kl_coef` > 0 adds `kl_coef` x the token mean of the k3 estimate of KL(policy || `ref_model`) (the
    reference evaluated at the same temperature, without gradient). Every response is then trained, those
    of groups without reward signal too: their tokens carry the KL term alone."""
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
    if kl_coef > 0 and ref_model is None:
        raise ValueError("kl_coef > 0 needs ref_model (the frozen reference policy)")
    rewards = np.array([r.reward for r in rollouts], dtype=np.float64)
    groups = np.array([r.group for r in rollouts])
    adv = group_advantages(rewards, groups)
    trained = list(range(len(rollouts))) if kl_coef > 0 else [i for i in range(len(rollouts)) if adv[i] != 0.0]
    model.train()
    losses, clipped, ntok, kl_sum = [], 0.0, 0, 0.0
    for s in range(0, len(trained), minibatch):
        idx = trained[s : s + minibatch]
        n = torch.tensor(float(max(1, sum(len(rollouts[i].response_ids) for i in idx))))
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for part in _length_sorted_parts(idx, rollouts, micro_batch or minibatch):
            obj_sum, kl_part, clipped_part, resp_tokens = _minibatch_part(
                model, ref_model, [rollouts[i] for i in part], adv[part], pad_id, clip_eps, temperature, kl_coef)
            loss = -obj_sum / n + (kl_coef * kl_part / n if kl_coef > 0 else 0.0)
            loss.backward()  # gradients accumulate: the parts' losses sum to the minibatch's loss
            loss_sum += loss.item()
            kl_sum += float(kl_part.detach()) if torch.is_tensor(kl_part) else float(kl_part)
            clipped += clipped_part
            ntok += resp_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(loss_sum)
    model.eval()
    return StepStats(
        loss=float(np.mean(losses)) if losses else 0.0,
        mean_reward=float(rewards.mean()),
        clip_fraction=clipped / max(ntok, 1),
        mean_abs_advantage=float(np.abs(adv).mean()),
        tokens=ntok,
        kl=kl_sum / max(ntok, 1),
    )


def _length_sorted_parts(idx: list[int], rollouts: list[Rollout], size: int) -> list[list[int]]:
    """A minibatch's rollouts in order of length, in parts of `size`: each part is padded to its own longest
    sequence, not the minibatch's (the lengths are heavy-tailed: padding to the longest of 32 responses wasted
    most of the update's compute), as RL trainers' dynamic batching does."""
    order = sorted(idx, key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].response_ids))
    return [order[s : s + size] for s in range(0, len(order), size)]


def _minibatch_part(model: torch.nn.Module, ref_model: torch.nn.Module | None, batch: list[Rollout], adv: np.ndarray,
                    pad_id: int, clip_eps: float, temperature: float, kl_coef: float
                    ) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Over one part of a minibatch: the sum of the clipped objective over response tokens, the sum of the k3
    KL estimate (0 without kl_coef), the clipped tokens and the response tokens."""
    device = _device(model)
    ids, attn, resp, old = _pad(batch, pad_id, device)
    a = torch.tensor(adv, dtype=torch.float32, device=device).unsqueeze(1)
    new = token_logprobs(model, ids, attn, temperature)
    ratio = torch.exp(new - old)
    obj = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    kl = _k3_kl_sum(ref_model, ids, attn, resp, new, temperature) if kl_coef > 0 else torch.zeros(())
    clipped = float((((ratio - 1).abs() > clip_eps) & resp).sum())
    return (obj * resp).sum(), kl, clipped, int(resp.sum())


def _k3_kl_sum(ref_model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor,
               new: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sum over response tokens of the k3 estimate of KL(policy || reference): r - log r - 1 with
    r = p_ref / p_new per sampled token (unbiased, always >= 0); the reference without gradient."""
    with torch.no_grad():
        ref = token_logprobs(ref_model, ids, attn, temperature)
    log_r = torch.where(resp, ref - new, torch.zeros_like(new))
    return ((torch.exp(log_r) - log_r - 1) * resp).sum()


def save_policy_weights(model: torch.nn.Module, tokenizer, out_dir: str | Path) -> Path:
    """Publish the policy for workers and sessions as a whole HF directory (write_dir_atomic): a reader never
    sees a half-written policy."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return write_dir_atomic(Path(out_dir), write)
