"""Sound promotion: the paired test's statistics (t quantiles against scipy, error rates by simulation), an
identical candidate never promoted over 200 noisy trials, a clearly better one promoted, racing proposers
never both current, and the staleness record each validation leaves."""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from tailspec.core import state
from tailspec.core.state import DrafterHealth, DrafterVersion
from tailspec.drafter_trainer.teacher import Teacher
from tailspec.drafter_trainer.training_session import TrainingSession
from tailspec.drafter_trainer.validation import decide, t_cdf, t_ppf
from tailspec.drafter_trainer.versions import VersionStore

from tests.test_trainer_session import cfg, frozen_teacher, synthetic_samples

torch.set_num_threads(1)


@pytest.mark.parametrize("df", [1, 2, 5, 15, 31, 63, 200])
@pytest.mark.parametrize("p", [0.5, 0.9, 0.95, 0.99])
def test_t_quantiles_match_scipy(df, p):
    stats = pytest.importorskip("scipy.stats")
    assert t_ppf(p, df) == pytest.approx(stats.t.ppf(p, df), abs=1e-6)
    assert t_cdf(1.7, df) == pytest.approx(stats.t.cdf(1.7, df), abs=1e-9)


def test_decision_error_rates():
    rng = random.Random(0)
    # Equal in expectation: promoted at most at the test's level (0.05; 400 trials: > 0.09 is > 3 sd off).
    null = sum(decide([rng.gauss(0, 0.3) for _ in range(32)]).promote for _ in range(400))
    assert null / 400 <= 0.09, null
    # Worse: (almost) never.
    assert sum(decide([rng.gauss(-0.1, 0.3) for _ in range(32)]).promote for _ in range(400)) <= 2
    # Clearly better (gain of one sd): promoted nearly always.
    assert sum(decide([rng.gauss(0.3, 0.3) for _ in range(32)]).promote for _ in range(200)) >= 195
    # Identical: every gain is 0, the bound is 0, never promoted; too few pairs: never promoted.
    d = decide([0.0] * 64)
    assert not d.promote and d.gain_lcb == 0.0
    few = decide([1.0, 1.1, 0.9], min_pairs=16)
    assert not few.promote and "too few" in few.reason


@pytest.fixture(scope="module")
def trained():
    """(teacher, held-out samples, untrained drafter, trained drafter) on a frozen random target."""
    teacher = frozen_teacher()
    from tests.test_trainer_session import make_buffer

    buf = make_buffer(200, holdout=0.2)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path

        s = TrainingSession(cfg(Path(tmp), lr=3e-3), teacher, buf)
        untrained = type(s.drafter)(s.drafter.config, teacher.embedding())
        untrained.load_state_dict(s.drafter.state_dict())
        s.run(max_steps=40)
    return teacher, list(buf.holdout) + synthetic_samples(60, seed=9), untrained, s.drafter


@pytest.mark.parametrize("backend", ["redis", "local"])
def test_identical_candidate_is_never_promoted(trained, tmp_path, redis_client, backend):
    teacher, holdout, untrained, better = trained
    store = VersionStore(tmp_path / "v", redis_client if backend == "redis" else None, "c")
    first = store.propose(better, teacher, holdout, k=3)
    assert first.promoted  # nothing to beat yet
    same = store.load(first.version, teacher.embedding())[0]  # identical weights, loaded from its own files
    rng = random.Random(1)
    for trial in range(200):  # noisy: a different held-out subset each trial
        subset = rng.sample(holdout, rng.randrange(16, 40))
        info = store.propose(same, teacher, subset, k=3)
        assert not info.promoted, (trial, info)
        assert info.gain_mean == 0.0 and info.gain_lcb == 0.0 and info.baseline_version == first.version
    assert store.current().version == first.version


def test_clearly_better_candidate_is_promoted_with_its_statistics(trained, tmp_path, redis_client):
    teacher, holdout, untrained, better = trained
    store = VersionStore(tmp_path / "v", redis_client, "c")
    v1 = store.propose(untrained, teacher, holdout, k=3)
    v2 = store.propose(better, teacher, holdout, k=3)
    assert v2.promoted and v2.baseline_version == v1.version and v2.pairs >= 16
    assert v2.gain_lcb > 0 and v2.gain_mean > v2.gain_lcb and "lower bound" in v2.decision
    assert v2.acceptance_length - v2.baseline_acceptance_length > 0
    assert state.get(redis_client, state.key("c", "drafter_current"), DrafterVersion).version == v2.version
    history = [state.decode(DrafterVersion, x) for x in redis_client.lrange(state.key("c", "drafter_versions"), 0, -1)]
    assert [h.version for h in history] == [v1.version, v2.version] and history[1].gain_lcb == v2.gain_lcb
    # the worse one back against it: rejected, with the reason
    v3 = store.propose(untrained, teacher, holdout, k=3)
    assert not v3.promoted and v3.gain_lcb < 0 and "<= 0" in v3.decision
    # each paired validation recorded the current version's acceptance now beside its value at promotion
    health = state.read_stream(redis_client, state.key("c", "drafter_health"), DrafterHealth)[0]
    assert [h.drafter_version for _, h in health] == [v1.version, v2.version]
    assert health[1][1].at_promotion == pytest.approx(v2.acceptance_length)
    assert health[1][1].acceptance_length == pytest.approx(v3.baseline_acceptance_length)


@pytest.mark.parametrize("backend", ["redis", "local"])
def test_racing_proposers_never_both_win(trained, tmp_path, redis_client, backend, monkeypatch):
    teacher, holdout, untrained, better = trained
    r = redis_client if backend == "redis" else None
    v1 = VersionStore(tmp_path / "v", r, "c").propose(untrained, teacher, holdout, k=3)
    # Both proposers validate against v1 and reach the swap together.
    barrier = threading.Barrier(2)
    real_swap = VersionStore._swap_current

    def swap_after_both_validated(self, expected, info):
        barrier.wait(timeout=60)
        return real_swap(self, expected, info)

    monkeypatch.setattr(VersionStore, "_swap_current", swap_after_both_validated)
    out: list[DrafterVersion] = []

    def propose() -> None:  # each proposer has its own teacher and candidate, as separate processes would
        mine = Teacher(copy.deepcopy(teacher.model), teacher.aux_layer_ids)
        cand = copy.deepcopy(better)
        cand.set_target_embedding(mine.embedding())
        out.append(VersionStore(tmp_path / "v", r, "c").propose(cand, mine, holdout, k=3))

    threads = [threading.Thread(target=propose) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 2 and all(o.baseline_version == v1.version for o in out)
    winners = [o for o in out if o.promoted]
    assert len(winners) == 1
    loser = next(o for o in out if not o.promoted)
    assert "lost the race" in loser.decision
    assert VersionStore(tmp_path / "v", r, "c").current().version == winners[0].version


def test_a_session_validating_checks_its_lease_between_small_teacher_batches(trained, tmp_path, redis_client):
    """A revoked session stops within one small teacher batch of its validation, not one batch of all samples."""
    from tailspec.drafter_trainer.loss import StopRequested
    from tailspec.drafter_trainer.validation import CHECKED_BATCH

    teacher, holdout, untrained, better = trained
    holdout = holdout[:32]  # one batch of the unchecked size; four of CHECKED_BATCH
    assert CHECKED_BATCH < 32
    store = VersionStore(tmp_path / "v", redis_client, "c")
    store.propose(untrained, teacher, holdout, k=3)
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise StopRequested("revoked")

    with pytest.raises(StopRequested):
        store.propose(better, teacher, holdout, k=3, check=check)
    assert len(calls) == 2  # stopped inside the first batch of CHECKED_BATCH samples, at its teacher's first layer
    assert store.current().version == 1  # nothing half-proposed


def test_a_validation_cut_short_is_resumed_not_restarted(trained, tmp_path, redis_client):
    """Scores of the batches finished before a stop are kept (by sample key), and the next validation of the
    same head and baseline scores only the rest: the result equals one uninterrupted run's.
    Through the store: a stop after the first batch leaves its scores in Redis; another identity starts over."""
    from tailspec.drafter_trainer.loss import StopRequested
    from tailspec.drafter_trainer.validation import sample_key, validate_paired

    teacher, holdout, untrained, better = trained
    samples = holdout[:24]
    ref = validate_paired(better, untrained, teacher, samples, k=3, batch_size=4)
    saved: dict = {}
    checks = 0

    # checks a batch: before it, before each of the teacher's layers, and before each drafter's scores
    per_batch = 1 + len(teacher.model.model.layers) + 2

    def stop_after_two():
        nonlocal checks
        checks += 1
        if checks > 3 * per_batch - 1:  # in the third batch, before the second drafter's scores
            raise StopRequested("revoked")

    with pytest.raises(StopRequested):
        validate_paired(better, untrained, teacher, samples, k=3, batch_size=4, check=stop_after_two,
                        on_batch=saved.update)
    assert len(saved) == 8 and set(saved) <= {sample_key(x) for x in samples}
    scored = []
    resumed = validate_paired(better, untrained, teacher, samples, k=3, batch_size=4, done=saved,
                              on_batch=lambda new: scored.extend(new))
    assert len(scored) == 16  # only the samples not scored before the stop
    assert resumed.candidate == pytest.approx(ref.candidate) and resumed.current == pytest.approx(ref.current)
    assert resumed.weights == ref.weights

    store = VersionStore(tmp_path / "v", redis_client, "resume")
    store.propose(untrained, teacher, samples, k=3)  # v1: the baseline
    calls = 0

    def stop_after_one():
        nonlocal calls
        calls += 1
        if calls > per_batch:  # the second batch's first check
            raise StopRequested("revoked")

    with pytest.raises(StopRequested):
        store.propose(better, teacher, samples, k=3, check=stop_after_one, lineage_head=7)
    key = state.key("resume", "drafter_validation")
    assert redis_client.hget(key, "id") == b"7:1:3" and redis_client.hlen(key) == 1 + 4
    done, _ = store._progress("7:1:3")
    assert len(done) == 4
    done, _ = store._progress("8:1:3")  # another head: starts over
    assert done == {} and redis_client.hlen(key) == 1


def test_a_resumed_validation_keeps_the_samples_it_scored():
    from tailspec.drafter_trainer.validation import pick_holdout, sample_key

    samples = synthetic_samples(10, seed=4)
    assert pick_holdout(samples, {}, None) == samples and pick_holdout(samples, {}, 20) == samples
    assert pick_holdout(samples, {}, 4) == samples[-4:]  # the newest
    done = {sample_key(x): (2.0, 1.5, 3) for x in samples[2:5]}
    got = pick_holdout(samples, done, 4)
    assert got == samples[2:5] + samples[-1:]  # what was scored, then the newest of the rest
    assert pick_holdout(samples, done, 2) == samples[3:5]
    # pairs scored on samples since gone from the held-out set count toward the n: fewer new ones are picked
    gone = {f"gone{i}": (2.0, 1.5, 3) for i in range(5)}
    assert pick_holdout(samples, {**done, **gone}, 10) == samples[2:5] + samples[-2:]
    assert pick_holdout(samples, gone, 5) == []


def test_pairs_of_samples_gone_from_the_holdout_count_in_the_test(trained):
    """A validation resumed after an RL step dropped the samples it had scored: their pairs still decide."""
    from tailspec.drafter_trainer.validation import sample_key, validate_paired

    teacher, holdout, untrained, better = trained
    first, later = holdout[:8], holdout[8:16]
    scored: dict = {}
    validate_paired(better, untrained, teacher, first, k=3, batch_size=4, on_batch=scored.update)
    both = validate_paired(better, untrained, teacher, later, k=3, batch_size=4, done=scored)
    alone = validate_paired(better, untrained, teacher, first + later, k=3, batch_size=4)
    assert sorted(both.gains) == pytest.approx(sorted(alone.gains))
    assert all(sample_key(x) in scored for x in first)


def test_a_clear_gain_is_promoted_at_the_interim_look(trained, tmp_path, redis_client):
    """Two tests at half the level each: a clearly better candidate is promoted when `min_pairs` samples are
    scored, without scoring the rest; the look is marked for the validation, and a validation resumed past
    `min_pairs` does not look again."""
    from tailspec.drafter_trainer.validation import validate_paired

    teacher, holdout, untrained, better = trained
    samples = holdout[:40]
    store = VersionStore(tmp_path / "v", redis_client, "look")
    v1 = store.propose(untrained, teacher, samples, k=3)
    v2 = store.propose(better, teacher, samples, k=3, lineage_head=5, min_pairs=16)
    assert v2.promoted and v2.pairs < len(samples) and v2.pairs >= 16 and "interim look" in v2.decision
    assert "97.5% lower bound" in v2.decision and v2.baseline_version == v1.version
    key = state.key("look", "drafter_validation")
    assert int(redis_client.hget(key, "look")) == v2.pairs
    assert redis_client.hlen(key) == 2 + v2.pairs  # id, look and the samples scored: the rest never were
    # the same validation resumed: no second look, every sample scored, and the look mark is not a score
    done, _ = store._progress("5:1:3")
    assert len(done) == v2.pairs and store._interim_look("5:1:3", 0.05, 16) is None
    # without a look the whole held-out set is scored; with one, a prefix of it, each sample scored the same
    full_scores: dict = {}
    looked_scores: dict = {}
    full = validate_paired(better, untrained, teacher, samples, k=3, batch_size=4, on_batch=full_scores.update)
    assert not full.stopped_early and len(full.gains) > v2.pairs
    looked = validate_paired(better, untrained, teacher, samples, k=3, batch_size=4, look_at=16,
                             look=lambda g: len(g) >= 16, on_batch=looked_scores.update)
    assert looked.stopped_early and 16 <= len(looked.gains) < len(full.gains)
    assert 16 <= len(looked_scores) < len(full_scores)
    for key, score in looked_scores.items():
        assert score == pytest.approx(full_scores[key]), key
