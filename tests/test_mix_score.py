"""Promotion scores what the engine spends: per-(depth, sibling rank) rates against a direct computation, a
strategy mix's score against a per-anchor evaluation (and a chain-of-4 mix against today's chain score), the roof's
reader of the published mix, the health guard judging tree steps by the validated rank table, a promotion through
the session path recording the mix it was scored under, and the demo report's line about it."""

from __future__ import annotations

import copy
import json
import time
from types import SimpleNamespace

import pytest
import torch
from tailspec.core import state
from tailspec.core.config import RolloutConfig, TailspecConfig, TrainerConfig
from tailspec.core.state import DrafterVersion, RolloutStats
from tailspec.drafter_trainer.loss import acceptance_rates, expected_length, rank_acceptance_rates
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.validation import validate, validate_paired
from tailspec.rollout.health_guard import GuardPolicy, HealthGuard, chain_alpha, guarded, validated_alpha
from tailspec.rollout.strategy import StepRecord, Strategy, expected_accepted

from tailspec.mix_score import latest_mix, mix_scoring, mix_weights, scoring_source
from tailspec.session_entry import Contributor, make_buffer
from tests.test_trainer_loss import _drafts_by_inference, _setup
from tests.test_trainer_session import frozen_teacher, synthetic_samples
from tests.test_trainer_session import make_buffer as session_buffer

torch.set_num_threads(1)
TREE = "tree2-1-1-1n5"  # the chain of 4 plus the root's second choice


# -- (a) the rates ---------------------------------------------------------------------------------------------
def test_rank_zero_is_the_chains_alpha_and_later_ranks_the_teachers_probability_of_the_drafters_siblings():
    _, d, ids, lengths, prompt_lens, g, tlogits = _setup(16)
    depth, ranks = 3, 3
    rates, valid = rank_acceptance_rates(d, g, tlogits, ids, lengths, prompt_lens, depth, ranks)
    alpha, valid_chain = acceptance_rates(d, g, tlogits, ids, lengths, prompt_lens, depth)
    assert rates.shape == (2, 11, depth, ranks)
    assert torch.equal(rates[..., 0], alpha) and torch.equal(valid, valid_chain)
    keep = torch.arange(16) + d.d2t
    with torch.no_grad():
        for b, anchor in ((0, 5), (1, 3)):
            assert bool(valid[b, anchor])
            drafts = _drafts_by_inference(d, g, ids, b, anchor, depth)
            for i in range(depth):
                order = torch.argsort(drafts[i], descending=True)  # draft ids, the drafter's likeliest first
                p = torch.softmax(tlogits[b, anchor + 1 + i], -1)
                for r in range(1, ranks):
                    assert rates[b, anchor, i, r].item() == pytest.approx(p[keep[order[r]]].item(), abs=1e-6)
    # more ranks than the draft vocabulary has tokens: the missing siblings rate 0
    wide, _ = rank_acceptance_rates(d, g, tlogits, ids, lengths, prompt_lens, 1, 18)
    assert torch.equal(wide[..., 16:], torch.zeros_like(wide[..., 16:])) and bool((wide[..., 1:16] > 0).all())


# -- (b) the score ---------------------------------------------------------------------------------------------
def test_a_mix_score_is_the_weighted_expectation_per_anchor():
    torch.manual_seed(0)
    rates = torch.rand(3, 5, 4, 2)
    scoring = mix_scoring({"chain3": 0.75, TREE: 0.25})
    assert (scoring.depth, scoring.ranks) == (4, 2)
    got = scoring.score(rates)
    assert got.shape == (3, 5)
    for b in range(3):
        for a in range(5):
            x = rates[b, a].tolist()
            chain3 = x[0][0] + x[0][0] * x[1][0] + x[0][0] * x[1][0] * x[2][0]
            # tree2-1-1-1n5: the chain of 4 and the root's rank-1 child
            tree = x[0][1] + sum(torch.tensor([x[d][0] for d in range(j + 1)]).prod().item() for j in range(4))
            assert got[b, a].item() == pytest.approx(0.75 * chain3 + 0.25 * tree, rel=1e-5)
            accept = lambda d, r, x=x: x[d][r]
            assert got[b, a].item() == pytest.approx(
                0.75 * expected_accepted(Strategy.chain(3), accept) + 0.25 * expected_accepted(Strategy.parse(TREE), accept),
                rel=1e-5)
    # a mix of one chain of 4 is today's chain score
    chain4 = mix_scoring({"chain4": 1.0})
    torch.testing.assert_close(1.0 + chain4.score(rates[..., :1]), expected_length(rates[..., 0]))


@pytest.fixture(scope="module")
def drafters():
    """(teacher, held-out samples, a drafter, another one): the session's drafter and a perturbed copy."""
    teacher = frozen_teacher()
    s = TrainingSession(TrainerConfig(batch_size=4, draft_vocab_size=16), teacher, session_buffer())
    other = copy.deepcopy(s.drafter)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return teacher, synthetic_samples(12, seed=4), s.drafter, other


def test_validation_under_a_chain_of_4_mix_is_todays_chain_validation(drafters):
    teacher, held, a, b = drafters
    chain4 = mix_scoring(mix_weights({"4": 7}))
    how = {"score": chain4.score, "depth": chain4.depth, "ranks": chain4.ranks}
    plain, mixed = validate(a, teacher, held, k=4), validate(a, teacher, held, k=4, **how)
    assert mixed.acceptance_length == pytest.approx(plain.acceptance_length, rel=1e-6)
    assert mixed.alpha == pytest.approx(plain.alpha, rel=1e-6) and mixed.anchors == plain.anchors
    assert plain.rank_rates is None and [len(row) for row in mixed.rank_rates] == [1, 1, 1, 1]
    p0, p1 = validate_paired(a, b, teacher, held, k=4), validate_paired(a, b, teacher, held, k=4, **how)
    assert p1.candidate == pytest.approx(p0.candidate, rel=1e-6) and p1.current == pytest.approx(p0.current, rel=1e-6)
    assert p1.weights == p0.weights and p0.rank_rates is None
    assert [r[0] for r in p1.rank_rates] == pytest.approx(mixed.alpha, rel=1e-6)  # the candidate's table
    # under trees the siblings count: each sample's score rises by what its anchors' siblings add
    tree = mix_scoring(mix_weights({"4": 1, TREE: 1}))
    p2 = validate_paired(a, b, teacher, held, k=4, score=tree.score, depth=tree.depth, ranks=tree.ranks)
    assert all(x > y for x, y in zip(p2.candidate, p0.candidate)) and len(p2.rank_rates[0]) == 2


# -- (c) the roof's reader of the published mix -----------------------------------------------------------------
def _stats(step: int, mix: dict[str, int], worker: str = "all") -> RolloutStats:
    return RolloutStats(worker=worker, step=step, tokens=100, seconds=1.0, target_forwards=50, drafted=0, accepted=0,
                        acceptance_length=2.0, strategy_mix=mix, ts=time.time())


def test_the_newest_published_mix_weighs_the_speculating_strategies(redis_client):
    key = state.key("mx", "rollout_stats")
    source = scoring_source(redis_client, "mx")
    assert latest_mix(redis_client, "mx") == {} and source(None) is None  # nothing published: a chain of k
    state.append(redis_client, key, _stats(1, {"0": 5, "4": 20}))
    state.append(redis_client, key, _stats(2, {"0": 10, "3": 30, TREE: 10}))
    assert latest_mix(redis_client, "mx") == {"0": 10, "3": 30, TREE: 10}  # the newest step only
    got = source(None)
    assert got.mix == {"chain3": 0.75, TREE: 0.25} and (got.depth, got.ranks) == (4, 2)
    # per-worker entries of one step are summed; the RL loop's total for it, when there is one, is the step's
    state.append(redis_client, key, _stats(3, {"2": 6}, worker="w0"))
    state.append(redis_client, key, _stats(3, {"2": 2, "dyn4x2n8": 4, "0": 9}, worker="w1"))
    assert mix_weights(latest_mix(redis_client, "mx")) == {"chain2": 2 / 3, "dyn4x2n8": 1 / 3}
    state.append(redis_client, key, _stats(3, {"1": 1}))
    assert latest_mix(redis_client, "mx") == {"1": 1}
    # a step that ran no speculation has nothing to weigh: a chain of k
    state.append(redis_client, key, _stats(4, {"0": 12}))
    assert source(None) is None
    # a kept mix is taken as it was recorded
    kept = {"chain3": 0.7, TREE: 0.3}
    assert source(kept).mix == kept
    assert mix_weights({"none": 3, "chain4": 1, "junk": 2}) == {"chain4": 1.0}


# -- (d) the health guard ---------------------------------------------------------------------------------------
def test_tree_steps_are_judged_by_the_validated_rank_table():
    """A drafter validated with rank-0 rates 0.5 and rank-1 rates 0.45 runs tree2-1-1-1n5 steps but accepts only
    what its chain of 4 would (its siblings never taken): the table expects 1.39 drafts a row from such a step
    and trips at 0.94; the chain fit of its acceptance length at k = 4 would expect 0.94 and call it healthy."""
    table = [[0.5, 0.45]] * 4
    tree = Strategy.parse(TREE)
    expected_tree = expected_accepted(tree, lambda d, r: table[d][r])
    chain = expected_accepted(Strategy.chain(4), lambda d, r: table[d][r])
    assert expected_tree == pytest.approx(1.3875) and chain == pytest.approx(0.9375)
    policy = GuardPolicy(window_steps=4, min_gain_share=0.75)
    verdicts = {}
    for name, rates in (("table", table), ("chain fit", None)):
        g = HealthGuard(policy)
        g.arm(version=3, validated=1.0 + chain, event="load", validated_k=4, rank_rates=rates)
        hook, seen = guarded(lambda b, last: tree, g, on_verdict=lambda v, n=name: verdicts.setdefault(n, v)), None
        for _ in range(4):
            seen = StepRecord.following(seen, rows=16, strategy=tree, accepted=15, reach=(8, 4, 2, 1), seconds=0.01)
            hook(16, seen)
    assert verdicts["table"].tripped and verdicts["table"].validated == pytest.approx(1 + expected_tree)
    assert "validated gain" in verdicts["table"].reason
    assert not verdicts["chain fit"].tripped and verdicts["chain fit"].validated == pytest.approx(1 + chain)
    # a chain step under the table expects the table's own chain; a table shallower than the step repeats its
    # deepest row, and a rank it never scored earns nothing
    g = HealthGuard(GuardPolicy(window_steps=1))
    g.arm(version=4, validated=None, event="load", rank_rates=[[0.8, 0.1], [0.5, 0.1]])
    assert g.observe(3, 10, 10).validated == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    g.arm(version=5, validated=None, event="load", rank_rates=[[0.8]])
    assert g.observe(Strategy.parse("tree2-1n3"), 10, 10).validated == pytest.approx(1 + 0.8 + 0.64)
    # a framework's totals at a mean draft length: between the table's two chains
    g.arm(version=6, validated=None, event="load", rank_rates=[[0.5]] * 4)
    assert g.observe_totals(2.5, 16, 16).validated == pytest.approx(1 + (0.75 + 0.875) / 2)


def test_the_worker_arms_its_guard_with_the_versions_rank_table(tmp_path):
    from tailspec.demo.worker import Worker, validated_version

    table = [[0.6, 0.3], [0.5, 0.2]]
    (tmp_path / "version.json").write_text(DrafterVersion(
        version=2, path=str(tmp_path), policy_version=0, acceptance_length=2.4, validation_k=4, promoted=True,
        created_at=0.0, scored_under={"chain2": 0.5, "tree2-1n3": 0.5}, rank_rates=table).model_dump_json())
    assert validated_version(str(tmp_path)).rank_rates == table
    w = SimpleNamespace(guard=None, drafter_module=object(), policy_key=None)
    item = SimpleNamespace(drafter_version=2, drafter_path=str(tmp_path))
    Worker._arm_guard(w, item, RolloutConfig(guard_window_steps=1), None, None)
    v = w.guard.observe(Strategy.parse("tree2-1n3"), 10, 10)  # the table's: 0.6 + 0.3 + 0.6 * 0.5
    assert w.guard.version == 2 and w.guard.event == "load" and v.validated == pytest.approx(1 + 1.2)
    # the tracker's prior: the table's chain of 4 (its deepest row repeated), not the mix's acceptance length
    chain4 = 0.6 + 0.3 + 0.15 + 0.075
    assert validated_alpha(2.4, 4, table) == pytest.approx(chain_alpha(1 + chain4, 4))
    assert validated_alpha(2.4, 4) == pytest.approx(chain_alpha(2.4, 4))


# -- (e) through the session path -------------------------------------------------------------------------------
def _contributor(redis_client, tmp_path, cluster: str, sid: str) -> Contributor:
    cfg = TailspecConfig.model_validate({"cluster": {"name": cluster}, "trainer": {
        "checkpoint_dir": str(tmp_path), "batch_size": 8, "draft_vocab_size": 16, "holdout_fraction": 0.3,
        "propose_min_steps": 1, "validation_k": 3, "merge_every_steps": 1, "lr": 3e-3}})
    return Contributor(cfg, frozen_teacher(), make_buffer(cfg), redis=redis_client, session_id=sid)


def test_a_promotion_records_the_mix_it_was_scored_under(redis_client, tmp_path):
    from tests.test_validation_resume import stop_on_call

    for s in synthetic_samples(120, seed=1, version=0):
        state.append(redis_client, state.key("ms", "samples"), s)
    a = _contributor(redis_client, tmp_path, "ms", "a")
    a.session.run(max_steps=2)
    first = a.propose()  # no mix published yet: a chain of validation_k, as before
    assert first.promoted and first.scored_under is None and first.rank_rates is None and first.validation_k == 3
    mix = {"0": 4, "3": 12, TREE: 4}
    state.append(redis_client, state.key("ms", "rollout_stats"), _stats(1, mix))
    a.session.run(max_steps=2)
    began = a.session.base
    a.session.check = stop_on_call(8)  # cut short after the first batch: its scores and its mix are kept
    assert a.propose() is None
    key = state.key("ms", "drafter_validation")
    assert json.loads(redis_client.hget(key, "mix")) == {"chain3": 0.75, TREE: 0.25}
    assert kept_pairs(redis_client, key) >= 1
    # the rollouts move on to another mix; the validation finishes under the one it began with
    state.append(redis_client, state.key("ms", "rollout_stats"), _stats(2, {"2": 10}))
    b = _contributor(redis_client, tmp_path, "ms", "b")
    b.session.run(max_steps=1)
    info = b.propose()
    assert info is not None and info.lineage_head == began.number and info.baseline_version == first.version
    assert info.scored_under == {"chain3": 0.75, TREE: 0.25} and info.validation_k == 3
    assert [len(row) for row in info.rank_rates] == [2, 2, 2, 2]
    assert all(0.0 <= x <= 1.0 for row in info.rank_rates for x in row)
    on_disk = DrafterVersion.model_validate_json((tmp_path / "versions" / f"v{info.version:05d}" /
                                                 "version.json").read_text())
    assert on_disk.scored_under == info.scored_under and on_disk.rank_rates == info.rank_rates
    # the next candidate is scored under the newest mix
    b.session.run(max_steps=2)
    assert b.propose().scored_under == {"chain2": 1.0}
    # the demo report says so, one line, from the version store's history
    from tailspec.demo.report import scoring_line

    (tmp_path / "run" / "drafter").mkdir(parents=True)
    (tmp_path / "run" / "drafter" / "versions").symlink_to(tmp_path / "versions")
    line = scoring_line(tmp_path / "run")
    assert line.startswith("- promoted versions were scored under") and "\n" not in line
    assert f"v{first.version} chain3 (no rollout strategy mix published yet)" in line
    for v in b.store.history():
        assert (f"v{v.version} " in line) == v.promoted


def test_the_report_says_which_mix_each_promoted_version_was_scored_under(tmp_path):
    from tailspec.demo.report import scoring_line

    root = tmp_path / "drafter" / "versions"
    root.mkdir(parents=True)
    base = {"path": "/x", "policy_version": 0, "created_at": 0.0}
    records = [
        DrafterVersion(version=1, promoted=True, note="the bootstrap drafter: not validated", **base),
        DrafterVersion(version=2, promoted=True, acceptance_length=2.5, validation_k=4, **base),
        DrafterVersion(version=3, promoted=False, acceptance_length=2.1, scored_under={"chain3": 1.0}, **base),
        DrafterVersion(version=4, promoted=True, acceptance_length=2.7, scored_under={"chain3": 0.25, TREE: 0.75},
                       rank_rates=[[0.5, 0.2]] * 4, **base),
    ]
    (root / "history.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in records) + "{damaged\n")
    assert scoring_line(tmp_path) == ("- promoted versions were scored under (share of decode steps, strategy): "
                                      f"v2 chain4 (no rollout strategy mix published yet); v4 0.75 {TREE} + 0.25 chain3")
    assert scoring_line(tmp_path / "elsewhere") is None


def kept_pairs(redis_client, key: str) -> int:
    """Held-out samples whose scores the cut-short validation kept (its fields but id and mix)."""
    return sum(1 for f in redis_client.hkeys(key) if f not in (b"id", b"mix", b"look"))


def test_an_old_version_record_still_loads():
    old = {"version": 1, "path": "/x", "policy_version": 0, "acceptance_length": 2.0, "promoted": True,
           "created_at": 0.0}
    v = DrafterVersion.model_validate(old)
    assert v.scored_under is None and v.rank_rates is None
