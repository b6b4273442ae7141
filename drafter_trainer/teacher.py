"""The teacher: the current policy's forward (no grad) over prompt + response → aux hidden states + logits.

In-process (`Teacher(model, ...)`, e.g. sharing the engine's model object when co-located) or loaded from
a policy directory (`Teacher.from_dir`, the RL framework's latest weights). The aux states are taken with
`model.capture_aux`, the same hooks the engine uses at inference, so training and drafting read the same
tensors.

`new_drafter` builds a new drafter for a teacher (a session's first head, or the lineage's seed): the EAGLE-3
head sized from the teacher's config, reading its aux layers, over its embedding and on its device.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from tailspec.core.config import TrainerConfig
from tailspec.core.state import Sample
from tailspec.drafter_trainer.eagle3_config import Eagle3Config, default_aux_layer_ids
from tailspec.drafter_trainer.layers import attention_backends
from tailspec.drafter_trainer.model import Eagle3Module, capture_aux, vocab_maps_from_counts
from tailspec.drafter_trainer.samples import SampleBuffer
from torch import nn


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] right-padded with 0 (a real id; masked out by lengths)
    lengths: torch.Tensor  # [B] prompt + response length
    prompt_lens: torch.Tensor  # [B]
    weights: torch.Tensor  # [B] per-sample reward weights

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: Any) -> "Batch":
        return Batch(self.ids.to(device), self.lengths.to(device), self.prompt_lens.to(device), self.weights.to(device))


def collate(samples: Sequence[Sample], weights: Sequence[float] | None = None) -> Batch:
    if not samples:
        raise ValueError("cannot collate an empty batch")
    seqs = [list(s.prompt_ids) + list(s.response_ids) for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    w = torch.ones(len(samples)) if weights is None else torch.as_tensor(list(weights), dtype=torch.float32)
    return Batch(ids, torch.tensor([len(x) for x in seqs]), torch.tensor([len(s.prompt_ids) for s in samples]), w)


@dataclass
class TeacherOutput:
    aux: torch.Tensor  # [B, T, 3H]
    logits: torch.Tensor  # [B, T, V] float32


class Teacher:
    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int], policy_version: int = 0,
                 path: str | None = None):
        self.model = model
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.policy_version = policy_version
        self.path = path

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def embedding(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @classmethod
    def from_dir(cls, path: str | Path, aux_layer_ids: Sequence[int] | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, policy_version: int = 0) -> "Teacher":
        # deferred: transformers (seconds to import); session, validation and versions import this module,
        # and only loading a teacher from a directory needs it
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a policy directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        ids = aux_layer_ids or default_aux_layer_ids(model.config.num_hidden_layers)
        return cls(model, ids, policy_version, str(path))

    @torch.no_grad()
    def __call__(self, batch: Batch, check: Callable[[], None] | None = None) -> TeacherOutput:
        """`check` (a session's stop check) runs before each decoder layer and may raise to abandon the forward:
        the teacher's forward is the longest unit of a session's step (the whole policy against the drafter's one
        layer), so checking only around it would keep a revoked GPU for up to a whole forward."""
        ids = batch.ids.to(self.device)
        t = ids.shape[1]
        mask = (torch.arange(t, device=ids.device)[None, :] < batch.lengths.to(ids.device)[:, None]).long()
        # the policy's own attention (HF sdpa) meets a new padded width with most batches: no cuDNN plan builds
        with capture_aux(self.model, self.aux_layer_ids) as got, attention_backends(ids.device), \
                checked_layers(self.model, check):
            out = self.model(input_ids=ids, attention_mask=mask, use_cache=False)
        return TeacherOutput(aux=got[-1], logits=out.logits.float())


@contextmanager
def checked_layers(model: nn.Module, check: Callable[[], None] | None) -> Iterator[None]:
    """Call `check()` before each decoder layer of `model` inside the block (nothing when `check` is None)."""
    if check is None:
        yield
        return

    def pre(_mod: nn.Module, _inp: Any) -> None:
        check()  # returns nothing: a pre-hook's return value would replace the layer's input

    handles = [layer.register_forward_pre_hook(pre) for layer in getattr(model, "model", model).layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def token_counts(buffer: SampleBuffer, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the buffer's training responses."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in buffer.train:
        counts += torch.bincount(torch.tensor(s.response_ids), minlength=vocab_size).double()
    return counts


def new_drafter(teacher: Teacher, cfg: TrainerConfig, buffer: SampleBuffer) -> Eagle3Module:
    """A new drafter for `teacher` (the module doc); its draft vocabulary is the buffer's most frequent response
    tokens when `trainer.draft_vocab_size` is smaller than the policy's."""
    dcfg = Eagle3Config.from_target(teacher.config, draft_vocab_size=cfg.draft_vocab_size,
                                    aux_layer_ids=teacher.aux_layer_ids)
    torch.manual_seed(cfg.seed)
    drafter = Eagle3Module(dcfg, teacher.embedding())
    if dcfg.draft_vocab_size < dcfg.vocab_size:
        drafter.set_vocab_maps(*vocab_maps_from_counts(token_counts(buffer, dcfg.vocab_size), dcfg.draft_vocab_size))
    return drafter.to(teacher.device)
