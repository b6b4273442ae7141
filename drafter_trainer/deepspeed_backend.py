"""DeepSpeed backend of a training session: ZeRO-2 with the optimizer state offloaded to CPU, so a session
stays small beside a resident rollout engine; data parallel across several lent GPUs when launched with
several ranks (each rank draws its own batches).

Choices, and why:
- A plain `torch.optim.AdamW` is passed in (with `zero_force_ds_cpu_optimizer: false`), so nothing has to
  compile DeepSpeed's fused / CPU Adam ops; on a GPU box with the ops built, DeepSpeedCPUAdam is faster.
- Without the `deepspeed` launcher the process needs RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
  MASTER_PORT; a single-process session sets them (rank 0 of 1, a free loopback port) if absent.
- CPU runs use the gloo backend. DeepSpeed's CPU accelerator JIT-builds its small shared-memory comm op
  on first use (cached under ~/.cache/torch_extensions; minutes on a busy 2-core machine, then seconds).
- Checkpoints stay in the project's format (checkpoint.py): the drafter's weights, and the base AdamW's
  own state over ZeRO's flat fp32 partition (a plain torch optimizer state_dict: safetensors + JSON, no
  pickle). The partition layout is deterministic for a given model and world size, so it restores into a
  session with the same world size.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch
from tailspec.core.config import TrainerConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def ds_config(cfg: TrainerConfig, world_size: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "train_batch_size": cfg.batch_size * world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": torch.cuda.is_available()},
            "contiguous_gradients": True,
            "overlap_comm": False,
        },
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend:
    name = "deepspeed"

    def __init__(self, drafter: torch.nn.Module, params: list[torch.nn.Parameter], cfg: TrainerConfig):
        # deferred: DeepSpeed, an optional extra (seconds to import); only trainer.backend=deepspeed needs it
        try:
            import deepspeed
        except ImportError as e:
            raise RuntimeError("trainer.backend=deepspeed needs DeepSpeed: "
                               "DS_BUILD_OPS=0 pip install 'tailspec[deepspeed]'") from e
        ensure_dist_env()
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=drafter, optimizer=opt, config=ds_config(cfg, self.world_size))

    def step(self, loss: torch.Tensor, check: Callable[[], None]) -> None:
        self.engine.backward(loss)
        check()
        self.engine.step()

    def state_dict(self) -> dict:
        return self.optimizer.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.optimizer.load_state_dict(sd)

    def close(self) -> None:
        self.optimizer.optimizer.state.clear()
        self.engine.destroy()
