"""Targets shipped by the rollout (drafter_trainer/rollout_targets.py): a session trained on them takes the very
steps it takes on the teacher's forward (the samples come from the teacher's own policy), and any batch whose
targets cannot all be read falls back to the teacher whole."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_helpers import micro_policy, random_eagle3, task_prompts
from tailspec.core.config import TrainerConfig
from tailspec.core.state import Sample
from tailspec.drafter_trainer.rollout_targets import load_targets, prune_targets, write_targets
from tailspec.drafter_trainer.samples import SampleBuffer
from tailspec.drafter_trainer.teacher import Teacher, collate
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.rollout.drafters import Eagle3Proposer
from tailspec.rollout.engine import Engine
from tailspec.rollout.sequence import SamplingParams


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """(policy, samples with shipped targets, root): 12 rollouts of the micro policy in two workers' files."""
    policy = micro_policy()[0]
    drafter = random_eagle3(policy)
    root = tmp_path_factory.mktemp("targets")
    samples = []
    for w in range(2):
        prompts = task_prompts(6, seed=20 + w)
        eng = Engine(policy, Eagle3Proposer(drafter, target=policy), selector=2, max_batch=6, max_seq_len=160,
                     record_states=True)
        outs = eng.generate(prompts, [SamplingParams(max_tokens=40, seed=w * 100 + i) for i in range(6)])
        d = write_targets(root, 3, f"w{w}", {str(i): o.states for i, o in enumerate(outs)},
                          drafter.config.aux_layer_ids)
        samples += [Sample(prompt_ids=p, response_ids=o.token_ids, reward=1.0 + i % 3, policy_version=3,
                           states_path=str(d), states_key=str(i)) for i, (p, o) in enumerate(zip(prompts, outs))]
    return policy, samples, root, drafter.config.aux_layer_ids


def test_loaded_targets_are_the_teachers_where_the_loss_reads(shipped):
    policy, samples, _, ids = shipped
    batch = collate(samples)
    got = load_targets(samples, ids, batch.ids.shape[1], torch.float32)
    ref = Teacher(policy, ids)(batch)
    for b, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        torch.testing.assert_close(got.aux[b, : n - 1], ref.aux[b, : n - 1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.logits[b, p - 1 : n - 1], ref.logits[b, p - 1 : n - 1], rtol=1e-4, atol=1e-4)


def _session(policy, ids, samples, source: str, tmp_path) -> TrainingSession:
    buf = SampleBuffer(capacity=100, holdout_fraction=0.0)
    for s in samples:
        buf.add(s)
    torch.manual_seed(0)
    cfg = TrainerConfig(lr=1e-3, batch_size=4, target_source=source, checkpoint_dir=str(tmp_path / source))
    return TrainingSession(cfg, Teacher(policy, ids), buf)


def test_a_session_on_shipped_targets_takes_the_teachers_steps(shipped, tmp_path):
    policy, samples, _, ids = shipped
    a = _session(policy, ids, samples, "rollout", tmp_path)
    b = _session(policy, ids, samples, "teacher", tmp_path)
    ra, rb = a.run(max_steps=4), b.run(max_steps=4)
    assert (ra.shipped_batches, rb.shipped_batches) == (4, 0)
    assert ra.losses == pytest.approx(rb.losses, rel=1e-4)
    for pa, pb in zip(a.drafter.parameters(), b.drafter.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-3, atol=1e-5)


def test_unusable_targets_fall_back_to_the_teacher(shipped, tmp_path):
    policy, samples, root, ids = shipped
    width = collate(samples).ids.shape[1]
    assert load_targets(samples[:1] + [samples[1].model_copy(update={"states_path": None})], ids, width,
                        torch.float32) is None  # one sample without a reference: the whole batch
    assert load_targets(samples[:2], [0, 1, 1], width, torch.float32) is None  # other aux layers
    longer = samples[0].model_copy(update={"response_ids": samples[0].response_ids + [5]})
    assert load_targets([longer], ids, width + 1, torch.float32) is None  # not this sample's targets
    a, v = load_targets(samples[:1], ids, width, torch.float32).aux.shape[-1], policy.config.vocab_size
    assert load_targets(samples[:1], ids, width, torch.float32, dims=(a, v)) is not None
    assert load_targets(samples[:1], ids, width, torch.float32, dims=(a + 1, v)) is None  # another hidden size
    flat = tmp_path / "flat"
    write_targets(flat, 3, "w9", {"0": (torch.zeros(7), torch.zeros(3, v))}, ids)  # a tensor of the wrong rank
    bad = samples[0].model_copy(update={"states_path": str(flat / "v3-w9"), "states_key": "0"})
    assert load_targets([bad], ids, width, torch.float32) is None
    moved = tmp_path / "moved"
    shutil.copytree(root, moved)
    assert prune_targets(moved, 4) == 2 and not any(moved.iterdir())  # versions below 4 removed
    assert prune_targets(root, 3) == 0
    gone = [s.model_copy(update={"states_path": str(moved / "v3-w0")}) for s in samples[:2]]
    assert load_targets(gone, ids, width, torch.float32) is None
    session = _session(policy, ids, gone, "rollout", tmp_path)
    assert session.run(max_steps=2).shipped_batches == 0  # trained on the teacher's forward instead
