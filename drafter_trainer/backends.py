"""The optimizer backends of a training session: `torch` (AdamW, here) and `deepspeed` (ZeRO-2 with the
optimizer offloaded to the CPU, deepspeed_backend.py)."""

from __future__ import annotations

from typing import Callable

import torch
from tailspec.core.config import TrainerConfig
from tailspec.drafter_trainer.deepspeed_backend import DeepSpeedBackend
from tailspec.drafter_trainer.model import Eagle3Module


class TorchBackend:
    name = "torch"

    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainerConfig):
        self.params = params
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, 0.95), weight_decay=cfg.weight_decay)

    def step(self, loss: torch.Tensor, check: Callable[[], None]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        check()
        self.apply()

    # Micro-batches: zero_grad, accumulate(loss) per micro-batch, apply(scale) once.
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, loss: torch.Tensor) -> None:
        loss.backward()

    def apply(self, scale: float = 1.0, lr_scale: float = 1.0) -> None:
        """Clip and step on the accumulated gradient x `scale` (a step cut short by a stop: batch tokens ÷
        tokens done, so its gradient is a per-token mean like a whole step's), at lr x `lr_scale`."""
        if scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        if lr_scale != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] = self.cfg.lr * lr_scale
        self.optimizer.step()
        if lr_scale != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] = self.cfg.lr

    def set_beta1(self, beta1: float) -> None:
        """AdamW's first-moment decay from the next step on (the delayed-merge momentum, see TrainingSession.merge)."""
        for g in self.optimizer.param_groups:
            g["betas"] = (beta1, g["betas"][1])

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        """The moments and step counts of `sd`; the hyperparameters stay this session's config (a saved state
        carries its writer's lr, which load_state_dict would otherwise restore)."""
        self.optimizer.load_state_dict(sd)
        for g in self.optimizer.param_groups:
            g.update(lr=self.cfg.lr, betas=(self.cfg.beta1, 0.95), weight_decay=self.cfg.weight_decay)

    def close(self) -> None:
        self.optimizer.state.clear()


def make_backend(params: list[torch.nn.Parameter], drafter: Eagle3Module, cfg: TrainerConfig):
    if cfg.backend == "torch":
        return TorchBackend(params, cfg)
    if cfg.backend == "deepspeed":
        return DeepSpeedBackend(drafter, params, cfg)
    raise ValueError(f"trainer.backend {cfg.backend!r} is not one of torch, deepspeed")
