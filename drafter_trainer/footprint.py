"""What a drafter-training session will need on its GPU, computed before it loads anything.

A session lent a GPU beside a rollout engine must not find out by running out of memory: it computes its
footprint from the policy directory's headers and the trainer config, compares it with the GPU's free memory
and declines when it does not fit (tailspec/session_entry.py). Nothing here touches a GPU or loads weights: the
teacher's size comes from the safetensors headers, the drafter's from building it on the meta device.

The estimate, in bytes:
- teacher weights: parameters × the session's dtype;
- drafter weights (fp32), their gradients (fp32) and AdamW's two moments (fp32): 16 bytes per trainable
  parameter;
- activations of one step: the teacher's fp32 logits and aux hidden states over a batch, and per unroll step
  the drafter's logits and hidden state (kept for backward), for `batch_size × max_seq_len` tokens;
- `margin` on the total (allocator fragmentation, CUDA context, workspace).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from tailspec.core.config import TrainerConfig
from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module

GIB = 1 << 30
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class Footprint:
    teacher: int
    drafter: int  # weights + gradients + optimizer state
    activations: int
    margin: float

    @property
    def total(self) -> int:
        return int((self.teacher + self.drafter + self.activations) * (1 + self.margin))

    def describe(self) -> str:
        return (f"{self.total / GIB:.3f} GiB (teacher {self.teacher / GIB:.3f}, drafter+grads+AdamW "
                f"{self.drafter / GIB:.3f}, activations {self.activations / GIB:.3f}, +{self.margin:.0%})")


def checkpoint_params(policy_dir: str | Path) -> int:
    """Number of parameters in a policy directory's safetensors files, read from their headers only."""
    d = Path(policy_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d} has no *.safetensors weights to size the teacher from")
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError(f"{f} is not a safetensors file (truncated header)")
            (size,) = struct.unpack("<Q", head)
            if size > 100_000_000:
                raise ValueError(f"{f}: safetensors header of {size} bytes is implausible")
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta.get("dtype") not in _DTYPE_BYTES:
                raise ValueError(f"{f}: tensor {name} has unknown dtype {meta.get('dtype')!r}")
            count = 1
            for s in meta["shape"]:
                count *= int(s)
            n += count
    return n


def drafter_trainable_params(target_config, cfg: TrainerConfig) -> int:
    """Trainable parameters of the EAGLE-3 drafter this config would build for the target (meta device)."""
    dcfg = Eagle3Config.from_target(target_config, draft_vocab_size=cfg.draft_vocab_size)
    with torch.device("meta"):
        d = Eagle3Module(dcfg)
    return sum(p.numel() for p in d.parameters() if p.requires_grad)


def session_footprint(policy_dir: str | Path, cfg: TrainerConfig, dtype: torch.dtype = torch.float32,
                      margin: float = 0.2) -> Footprint:
    """The GPU memory a session distilling from `policy_dir` with trainer config `cfg` needs (see module doc).
    Remembered per (config.json, weight files' names and sizes, the config fields it reads): every RL step
    publishes a policy directory of the same shapes, and the computation (reading the config, building the
    drafter on the meta device, the headers) was a fifth of a lend's start-up on the deep preset."""
    d = Path(policy_dir)
    try:
        files = tuple((f.name, f.stat().st_size) for f in sorted(d.glob("*.safetensors")))
        key = ((d / "config.json").read_text(), files, cfg.draft_vocab_size, cfg.batch_size, cfg.max_seq_len,
               cfg.ttt_length, str(dtype), margin)
    except OSError:
        key = None  # no config.json: computed below, which names what is missing
    if key is not None and key in _FOOTPRINTS:
        return _FOOTPRINTS[key]
    fp = _footprint(d, cfg, dtype, margin)
    if key is not None:
        _FOOTPRINTS.clear()  # one policy at a time
        _FOOTPRINTS[key] = fp
    return fp


_FOOTPRINTS: dict[tuple, Footprint] = {}


def _footprint(policy_dir: Path, cfg: TrainerConfig, dtype: torch.dtype, margin: float) -> Footprint:
    # deferred: transformers (seconds to import); the drafter_trainer modules load without it, and only
    # reading the policy's config needs it
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(str(policy_dir))
    wbytes = torch.empty((), dtype=dtype).element_size()
    teacher = checkpoint_params(policy_dir) * wbytes
    drafter = drafter_trainable_params(tc, cfg) * 16
    tokens = cfg.batch_size * cfg.max_seq_len
    hidden, vocab = int(tc.hidden_size), int(tc.vocab_size)
    draft_vocab = int(cfg.draft_vocab_size or vocab)
    per_token = 4 * vocab + 3 * hidden * wbytes + cfg.ttt_length * 4 * (2 * draft_vocab + 4 * hidden)
    return Footprint(teacher, drafter, tokens * per_token, margin)
