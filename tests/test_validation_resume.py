"""A validation cut short by its session's stop is finished by a later session on the lineage head it began
with, even when the head has moved on meanwhile; the scores kept are not computed again."""

from __future__ import annotations

import torch
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.drafter_trainer.loss import StopRequested
from tailspec.drafter_trainer.validation import CHECKED_BATCH

from tailspec.session_entry import Contributor, make_buffer
from tests.test_trainer_session import frozen_teacher, synthetic_samples

torch.set_num_threads(1)


class CountingTeacher:
    """The session's teacher, counting its forwards."""

    def __init__(self, teacher):
        self.inner, self.calls = teacher, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, batch, check=None):
        self.calls += 1
        return self.inner(batch, check)


def stop_on_call(n: int):
    calls = 0

    def check():
        nonlocal calls
        calls += 1
        if calls >= n:
            raise StopRequested("revoked")

    return check


def test_the_next_session_finishes_a_validation_cut_short_on_the_head_it_began(redis_client, tmp_path):
    for s in synthetic_samples(120, seed=1, version=0):
        state.append(redis_client, state.key("vr", "samples"), s)
    cfg = TailspecConfig.model_validate({"cluster": {"name": "vr"}, "trainer": {
        "checkpoint_dir": str(tmp_path), "batch_size": 8, "draft_vocab_size": 16, "holdout_fraction": 0.3,
        "propose_min_steps": 1, "validation_k": 3, "merge_every_steps": 1, "lr": 3e-3}})
    teacher = frozen_teacher()
    a = Contributor(cfg, teacher, make_buffer(cfg), redis=redis_client, session_id="a")
    a.session.run(max_steps=2)
    assert a.propose().promoted  # v1, the baseline
    a.session.run(max_steps=2)
    began = a.session.base
    # 7 checks a batch (before it, before each of the teacher's 4 layers, before each drafter's unroll):
    # stopped before the second batch
    a.session.check = stop_on_call(8)
    assert a.propose() is None
    key = state.key("vr", "drafter_validation")
    assert redis_client.hget(key, "id") == f"{began.number}:1:3".encode()
    assert redis_client.hlen(key) == 1 + CHECKED_BATCH
    weights = {n: p.detach().clone() for n, p in a.session.drafter.state_dict().items()}

    b = Contributor(cfg, teacher, make_buffer(cfg), redis=redis_client, session_id="b")
    b.session.run(max_steps=1)
    assert b.session.base.number > began.number  # the head moved on
    b.teacher = CountingTeacher(teacher)
    info = b.propose()
    assert info is not None and info.lineage_head == began.number and info.lineage_steps == began.steps
    held_out = len(b.buffer.holdout)
    # every held-out sample, or the first batch past promotion_min_pairs (16) when the interim look promoted
    scored = min(held_out, -(-16 // CHECKED_BATCH) * CHECKED_BATCH) if "interim look" in info.decision else held_out
    assert info.pairs == scored
    assert b.teacher.calls == -(-(scored - CHECKED_BATCH) // CHECKED_BATCH)  # only what was not scored
    saved = b.store.load(info.version, teacher.embedding())[0].state_dict()
    for n, w in weights.items():
        torch.testing.assert_close(saved[n], w, msg=n)
    assert not any((tmp_path / "versions" / "pending").iterdir())
    # b's own, newer head is the next candidate
    assert b.propose().lineage_head == b.session.base.number


def test_no_validation_on_a_held_out_set_too_small_to_pass_the_test(redis_client, tmp_path):
    """A head is not validated while fewer held-out samples than promotion_min_pairs exist: it could only be
    recorded as 'too few', and the lent time goes to training."""
    for s in synthetic_samples(40, seed=2, version=0):
        state.append(redis_client, state.key("few", "samples"), s)
    cfg = TailspecConfig.model_validate({"cluster": {"name": "few"}, "trainer": {
        "checkpoint_dir": str(tmp_path), "batch_size": 8, "draft_vocab_size": 16, "holdout_fraction": 0.3,
        "propose_min_steps": 1, "validation_k": 3, "merge_every_steps": 1, "promotion_min_pairs": 16}})
    c = Contributor(cfg, frozen_teacher(), make_buffer(cfg), redis=redis_client, session_id="c")
    assert 0 < len(c.buffer.holdout) < 16
    c.session.run(max_steps=2)
    assert c.propose().version == 1  # the first version needs no test: taken on any held-out set
    c.session.run(max_steps=2)
    spent = c.validate_s
    assert c.propose() is None and c.validate_s == spent  # against v1 it could not pass: not validated
    assert not redis_client.exists(state.key("few", "drafter_validating"))
    cfg.trainer.promotion_min_pairs = len(c.buffer.holdout)
    assert c.propose().version == 2
