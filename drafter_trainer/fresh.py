"""A new drafter for a policy: the EAGLE-3 head sized from the teacher's config, its draft vocabulary the
buffer's most frequent tokens (a session's first head, or the lineage's seed)."""

from __future__ import annotations

import torch
from tailspec.core.config import TrainerConfig
from tailspec.drafter_trainer.model import Eagle3Config, Eagle3Module, vocab_maps_from_counts
from tailspec.drafter_trainer.samples import SampleBuffer
from tailspec.drafter_trainer.teacher import Teacher


def token_counts(buffer: SampleBuffer, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in buffer.train:
        counts += torch.bincount(torch.tensor(s.response_ids), minlength=vocab_size).double()
    return counts


def new_drafter(teacher: Teacher, cfg: TrainerConfig, buffer: SampleBuffer) -> Eagle3Module:
    dcfg = Eagle3Config.from_target(teacher.config, draft_vocab_size=cfg.draft_vocab_size,
                                    aux_layer_ids=teacher.aux_layer_ids)
    torch.manual_seed(cfg.seed)
    drafter = Eagle3Module(dcfg, teacher.embedding())
    if dcfg.draft_vocab_size < dcfg.vocab_size:
        drafter.set_vocab_maps(*vocab_maps_from_counts(token_counts(buffer, dcfg.vocab_size), dcfg.draft_vocab_size))
    return drafter.to(teacher.device)
