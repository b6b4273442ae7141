"""Training raises the expected acceptance length at k = 4 by >= 1.0 over the untrained drafter, on the tiny
task policy's own samples (held-out samples, teacher = the policy). Uses the cached tiny policy and samples
(built on first use: minutes)."""

from __future__ import annotations

import pytest
import torch
from tailspec.core.config import TrainerConfig
from tailspec.drafter_trainer.samples import SampleBuffer
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.validation import validate

K = 4
# (preset, optimizer steps, learning rate): the tiny policy is the figure that matters (slow: its samples
# and policy are built on first use); the micro one checks the same path faster.
RUNS = [
    pytest.param("micro", 30, 3e-3, id="micro", marks=pytest.mark.slow),
    pytest.param("tiny", 60, 1e-3, id="tiny", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("preset,steps,lr", RUNS)
def test_training_raises_acceptance(tmp_path, preset, steps, lr):
    from tests.trainer_data import policy_samples

    torch.set_num_threads(2)
    path, samples = policy_samples(preset, n=160, seed=1)
    teacher = Teacher.from_dir(path)
    buf = SampleBuffer(capacity=10_000, holdout_fraction=0.2)
    for s in samples:
        buf.add(s)
    holdout = list(buf.holdout)[:32]
    cfg = TrainerConfig(lr=lr, batch_size=16, ttt_length=3, checkpoint_dir=str(tmp_path))
    session = TrainingSession(cfg, teacher, buf)
    before = validate(session.drafter, teacher, holdout, k=K)
    session.run(max_steps=steps)
    after = validate(session.drafter, teacher, holdout, k=K)
    assert after.acceptance_length >= before.acceptance_length + 1.0, (before, after)
    # Acceptance falls with depth for an imperfect drafter, but every position improved.
    assert all(a > b for a, b in zip(after.alpha, before.alpha))
