"""`tailspec bench cotrain --alternate`: sessions taking turns one merge chunk each in one process, on a tiny target.
The run is deterministic (the point of the mode: the merge rule's cost without the timing), every session
contributes its share, and with two sessions the head is not the one-session head (each delta was delayed)."""

from __future__ import annotations

from argparse import Namespace

import torch
from tailspec.benchmarks.cotrain import run_alternating
from tailspec.core.config import TailspecConfig
from tailspec.drafter_trainer.checkpoint import load_checkpoint
from tailspec.drafter_trainer.teacher import new_drafter

from tests.test_trainer_session import frozen_teacher, make_buffer, synthetic_samples


def _heads(tmp_path, n: int, runs: int = 2) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    teacher = frozen_teacher()
    cfg = TailspecConfig()
    cfg.trainer = cfg.trainer.model_copy(update={"batch_size": 4, "lr": 1e-3, "draft_vocab_size": 16,
                                                 "merge_every_steps": 2, "holdout_fraction": 0.0})
    torch.manual_seed(0)
    boot = tmp_path / "boot"
    new_drafter(teacher, cfg.trainer, make_buffer()).save(boot)
    out = []
    for i in range(runs):
        res = run_alternating(n, Namespace(steps=8), cfg, str(boot), synthetic_samples(64), teacher, tmp_path / f"{n}-{i}")
        ck = load_checkpoint(res["head"].path, teacher.embedding())
        out.append((res, {k: v.clone() for k, v in ck.drafter.state_dict().items()}))
    return out


def test_taking_turns_is_deterministic_and_every_session_contributes(tmp_path):
    (one, w1), = _heads(tmp_path / "a", 1, runs=1)
    (two, w2), (again, w2b) = _heads(tmp_path / "b", 2)
    assert one["head"].steps == two["head"].steps == 8
    assert {k: v for k, v in two["contributions"].items() if v} == {"s2-0": 4, "s2-1": 4}
    assert all(torch.equal(w2[k], w2b[k]) for k in w2)  # the same turns, the same head, to the last bit
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)  # delayed deltas: not the one-session head
