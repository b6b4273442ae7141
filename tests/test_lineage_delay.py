"""The delay-aware parts of the lineage's merge: the outer learning rate applies to a delayed delta only (one
contributor is plain training whatever it is), and a session whose merge found other sessions' merges runs its
next chunk with trainer.merge_delayed_beta1, one whose merge found none with trainer.beta1 (bit for bit the
same training as without the rule)."""

from __future__ import annotations

import torch
from tailspec.drafter_trainer.lineage import MERGED, Lineage, snapshot
from tailspec.drafter_trainer.training_session import TrainingSession

from tests.test_lineage import tiny_drafter
from tests.test_trainer_session import cfg, frozen_teacher, make_buffer

torch.set_num_threads(1)


def test_outer_lr_scales_only_a_delayed_delta(redis_client, tmp_path):
    init = tiny_drafter()  # integer weights: 1.5 * an even integer delta is exact
    lin = Lineage(tmp_path, redis_client, "c", outer_lr=1.5)
    lin.seed(init)
    start = snapshot(init)
    (ha, cka), (hb, ckb) = lin.pull(), lin.pull()
    base_a, base_b = snapshot(cka.drafter), snapshot(ckb.drafter)
    with torch.no_grad():
        for p in cka.drafter.parameters():
            p.add_(2.0)
        for p in ckb.drafter.parameters():
            p.sub_(4.0)
    a = lin.merge(ha, base_a, cka.drafter, None, {}, "a", 1, steps=1)
    assert a.code == MERGED
    for n, p in cka.drafter.named_parameters():  # nobody merged since a's base: a's weights exactly
        assert torch.equal(a.weights[n], p.detach()), n
    b = lin.merge(hb, base_b, ckb.drafter, None, {}, "b", 1, steps=1)  # a's merge landed since b's base
    assert b.code == MERGED
    for n, w in b.weights.items():
        assert torch.equal(w, start[n] + 2.0 - 1.5 * 4.0), n


def _session(tmp_path, teacher, redis, sid: str, **kw) -> TrainingSession:
    c = cfg(tmp_path, beta1=0.9, merge_rule="async", **kw)  # the delayed merge is the asynchronous rule's
    return TrainingSession(c, teacher, make_buffer(), lineage=Lineage(tmp_path / "lineage", redis, "c"),
                           session_id=sid)


def _beta1(s: TrainingSession) -> float:
    return s.backend.optimizer.param_groups[0]["betas"][0]


def _chunk(s: TrainingSession, steps: int = 2):
    for _ in range(steps):
        assert s.train_step() is not None
    return s.merge()


def test_one_contributor_is_unchanged_by_the_delayed_momentum(redis_client, tmp_path):
    teacher = frozen_teacher()
    heads = []
    for i, delayed_beta1 in enumerate((0.0, 0.9)):  # the rule on (default) and off
        redis_client.flushall()
        s = _session(tmp_path / str(i), teacher, redis_client, "solo", merge_delayed_beta1=delayed_beta1)
        for _ in range(3):
            assert _chunk(s).merged
            assert _beta1(s) == 0.9  # no merge found another's: plain AdamW
        heads.append({n: p.detach().clone() for n, p in s.drafter.named_parameters()})
    for n, w in heads[0].items():
        assert torch.equal(w, heads[1][n]), n


def test_a_delayed_merge_drops_momentum_for_the_next_chunk(redis_client, tmp_path):
    teacher = frozen_teacher()
    a = _session(tmp_path, teacher, redis_client, "a", merge_delayed_beta1=0.25)
    b = _session(tmp_path, teacher, redis_client, "b", merge_delayed_beta1=0.25)
    assert _chunk(a).merged and _beta1(a) == 0.9  # first to merge since the base both started from
    assert _chunk(b).merged and _beta1(b) == 0.25  # a merged since b's base
    assert _chunk(b).merged and _beta1(b) == 0.9  # nobody merged since b's last merge
    assert _chunk(a).merged and _beta1(a) == 0.25  # b merged twice since a's base
    # the optimizer state a merge writes carries the chunk's betas; a session that loads it uses its config's
    c = _session(tmp_path, teacher, redis_client, "c", merge_delayed_beta1=0.25)
    assert _beta1(c) == 0.9


def test_by_default_a_delayed_merge_keeps_momentum(redis_client, tmp_path):
    teacher = frozen_teacher()
    a = _session(tmp_path, teacher, redis_client, "a")
    b = _session(tmp_path, teacher, redis_client, "b")
    assert a.cfg.merge_delayed_beta1 is None
    assert _chunk(a).merged and _chunk(b).merged  # b's merge is delayed (a merged since b's base)
    assert _beta1(b) == 0.9 and _chunk(a).merged and _beta1(a) == 0.9
