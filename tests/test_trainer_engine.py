"""The rollout engine loads an exported EAGLE-3 directory and decodes losslessly with it; a drafter trained by
the trainer on the target's own outputs is accepted there (the TTT unroll matches the engine's drafting)."""

from __future__ import annotations

import random

import pytest
import torch
from tailspec.core.state import Sample
from tailspec.drafter_trainer.export import export, load_export
from tailspec.drafter_trainer.samples import SampleBuffer
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.validation import validate

from tests.test_trainer_model import make_target
from tests.test_trainer_session import cfg

rollout = pytest.importorskip("tailspec.rollout.engine")
from tailspec.rollout.drafters import Eagle3Proposer  # noqa: E402
from tailspec.rollout.engine import Engine  # noqa: E402
from tailspec.rollout.sequence import SamplingParams  # noqa: E402

torch.set_num_threads(1)


def test_engine_decodes_losslessly_with_exported_drafter(tmp_path):
    target = make_target(layers=4, seed=3)
    for p in target.parameters():
        p.requires_grad_(False)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(4, 21) for _ in range(rng.randrange(3, 8))] for _ in range(48)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = Engine(target, None, selector=0, max_batch=16, max_seq_len=64, seed=0)
    ref = [o.token_ids for o in plain.generate(prompts, greedy)]
    # Train on the target's own greedy continuations (a quick session), then export for serving.
    buf = SampleBuffer(capacity=1000, holdout_fraction=0.0)
    for p, r in zip(prompts, ref):
        buf.add(Sample(prompt_ids=p, response_ids=r, reward=1.0, policy_version=0))
    teacher = Teacher(target, (1, 2, 3))
    s = TrainingSession(cfg(tmp_path, lr=3e-3, batch_size=8, ttt_length=3), teacher, buf)
    before = validate(s.drafter, teacher, list(buf.train)[:16], k=3, temperature=0.3).acceptance_length
    s.run(max_steps=60)
    after = validate(s.drafter, teacher, list(buf.train)[:16], k=3, temperature=0.3).acceptance_length
    assert after > before
    out = export(s.drafter, tmp_path / "eagle3", "eagle3")
    drafter = load_export(out, target.get_input_embeddings())
    for k in (1, 3):
        engine = Engine(target, Eagle3Proposer(drafter, target), selector=k, max_batch=16, max_seq_len=64, seed=0)
        outs = engine.generate(prompts, greedy)
        assert [o.token_ids for o in outs] == ref, k  # lossless: token-identical to the target alone
        drafted = sum(o.stats.drafted for o in outs)
        accepted = sum(o.stats.accepted for o in outs)
        assert drafted > 0 and accepted > 0
    # The trained drafter is accepted far more often than chance in the engine.
    assert accepted / drafted > 0.3, (accepted, drafted)

