"""Sample validation, drop counting (locally and in Redis), the versioned bounded buffer, held-out split."""

from __future__ import annotations

import math
import random

import pytest
from tailspec.core import state
from tailspec.core.state import Sample
from tailspec.drafter_trainer.samples import SampleBuffer, SampleReader, is_holdout, validate_sample


def S(prompt=(1, 2, 3), response=(4, 5, 6), reward=1.0, version=0, group=None) -> Sample:
    return Sample(prompt_ids=list(prompt), response_ids=list(response), reward=reward, policy_version=version,
                  group_id=group)


def test_validate_reasons():
    assert validate_sample(S(), 21, 64) is None
    assert validate_sample(S(response=()), 21, 64) == "empty_response"
    assert validate_sample(S(prompt=()), 21, 64) == "empty_prompt"
    assert validate_sample(S(response=(4, 21)), 21, 64) == "out_of_vocab"
    assert validate_sample(S(prompt=(-1, 2)), 21, 64) == "out_of_vocab"
    assert validate_sample(S(reward=math.nan), 21, 64) == "nonfinite_reward"
    assert validate_sample(S(reward=math.inf), 21, 64) == "nonfinite_reward"
    assert validate_sample(S(response=tuple(range(1, 20)) * 4), 21, 64) == "oversized"


def test_reader_drops_and_counts_bad_samples(redis_client):
    cluster = "t"
    key = state.key(cluster, "samples")
    good = [S(response=(4, 5, i % 20)) for i in range(30)]
    bad = [S(response=(99,)), S(response=()), S(reward=math.nan), S(response=(1,) * 200)]
    for s in good[:10] + bad + good[10:]:
        # NaN cannot travel as JSON; write it raw the way a careless client would (json allows NaN).
        raw = s.model_dump_json() if math.isfinite(s.reward) else s.model_dump_json().replace('"reward":null', '"reward":NaN')
        redis_client.xadd(key, {"data": raw})
    redis_client.xadd(key, {"data": b"{not json"})
    redis_client.xadd(key, {"wrong_field": b"x"})
    buf = SampleBuffer(capacity=100, holdout_fraction=0.0)
    reader = SampleReader(redis_client, cluster, buf, vocab_size=21, max_seq_len=64)
    assert reader.poll() == 30
    assert len(buf) == 30
    dropped = {k.decode(): int(v) for k, v in redis_client.hgetall(state.key(cluster, "dropped")).items()}
    # The NaN reward fails the schema (reward must be a number) or validation, whichever sees it first.
    assert dropped["trainer_out_of_vocab"] == 1
    assert dropped["trainer_empty_response"] == 1
    assert dropped["trainer_oversized"] == 1
    assert dropped.get("trainer_nonfinite_reward", 0) + dropped["trainer_malformed"] == 3
    assert sum(reader.dropped.values()) == 6
    # Nothing new → nothing added; new entries are picked up from where the reader stopped.
    assert reader.poll() == 0
    state.append(redis_client, key, S())
    assert reader.poll() == 1


def test_offer_counts_nonfinite_reward(redis_client):
    buf = SampleBuffer(capacity=10, holdout_fraction=0.0)
    reader = SampleReader(redis_client, "t", buf, vocab_size=21, max_seq_len=64)
    assert reader.offer(S(reward=math.nan)) == "nonfinite_reward"
    assert reader.dropped["nonfinite_reward"] == 1 and len(buf) == 0


def test_buffer_keeps_recent_policy_versions_and_capacity():
    buf = SampleBuffer(capacity=5, keep_policy_versions=2, holdout_fraction=0.0)
    for v in (0, 0, 1, 1):
        buf.add(S(version=v))
    assert buf.versions == [0, 1] and len(buf) == 4
    buf.add(S(version=2))
    assert buf.versions == [1, 2] and {s.policy_version for s in buf.train} == {1, 2} and len(buf) == 3
    assert buf.add(S(version=0)) == "stale"
    for _ in range(10):
        buf.add(S(version=2))
    assert len(buf) == 5  # bounded: the most recent kept


def test_holdout_split_is_stable_and_disjoint():
    rng = random.Random(0)
    samples = [S(prompt=[rng.randrange(21) for _ in range(5)], response=[rng.randrange(21) for _ in range(8)])
               for _ in range(400)]
    buf = SampleBuffer(capacity=1000, holdout_fraction=0.2)
    for s in samples:
        buf.add(s)
    frac = len(buf.holdout) / 400
    assert 0.1 < frac < 0.3
    assert all(is_holdout(s, 0.2) for s in buf.holdout) and not any(is_holdout(s, 0.2) for s in buf.train)


def test_batch_weights_follow_buffer():
    buf = SampleBuffer(capacity=10, holdout_fraction=0.0, mode="reward", w_min=0.1, w_max=5.0)
    for r in (0.0, 1.0, 1.0, 0.0):
        buf.add(S(reward=r))
    samples, w = buf.batch(8, random.Random(0))
    for s, wi in zip(samples, w):
        assert wi == (2.0 if s.reward == 1.0 else 0.1)


@pytest.mark.parametrize("stale_weight", [0.5, 0.0])
def test_a_sessions_first_batch_comes_from_the_newest_policy_versions(redis_client, tmp_path, stale_weight):
    """30 policy versions in the stream, oldest first: a new session reads from the newest end, so its first
    batch is of the newest versions (only the newest at weight 0), and it follows new entries afterwards."""
    from tailspec.core.config import TailspecConfig

    from tailspec.session_entry import Contributor, make_buffer
    from tests.test_trainer_session import frozen_teacher, synthetic_samples

    for v in range(30):
        for s in synthetic_samples(40, seed=v, version=v):
            state.append(redis_client, state.key("fr", "samples"), s)
    cfg = TailspecConfig.model_validate({"cluster": {"name": "fr"}, "trainer": {
        "checkpoint_dir": str(tmp_path), "batch_size": 16, "draft_vocab_size": 16, "buffer_size": 64,
        "stale_version_weight": stale_weight}})
    teacher = frozen_teacher()
    trainer = Contributor(cfg, teacher, make_buffer(cfg), redis=redis_client)
    drawn: list[list[int]] = []
    real_batch = trainer.buffer.batch

    def recording_batch(n, rng):
        samples, w = real_batch(n, rng)
        drawn.append([s.policy_version for s in samples])
        return samples, w

    trainer.buffer.batch = recording_batch
    assert trainer.session.train_step() is not None
    allowed = {29} if stale_weight == 0 else {29, 28}
    assert set(drawn[0]) <= allowed, drawn[0]
    assert 29 in drawn[0]
    # the reader goes on forward from the newest entry it read
    for s in synthetic_samples(8, seed=99, version=30):
        state.append(redis_client, state.key("fr", "samples"), s)
    assert trainer.reader.poll() == 8
    assert trainer.buffer.policy_version() == 30


def test_older_versions_are_drawn_with_weight_w_to_the_age():
    buf = SampleBuffer(capacity=1000, keep_policy_versions=2, holdout_fraction=0.0, stale_version_weight=0.5)
    for s in [S(response=(4, 5, 6 + i % 9), version=v) for v in (4, 5) for i in range(100)]:
        buf.add(s)
    rng = random.Random(0)
    drawn = [s.policy_version for _ in range(200) for s in buf.batch(16, rng)[0]]
    old = drawn.count(4) / len(drawn)
    assert old == pytest.approx(50 / 150, abs=0.03)  # 100·0.5 / (100 + 100·0.5)
