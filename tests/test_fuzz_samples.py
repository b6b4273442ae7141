"""Bad input, fuzzed: malformed and oversized entries written straight into the sample stream (XADD around the
client: garbage fields, bytes that are not JSON, wrong JSON, truncated JSON, missing and unknown fields,
wrong-length logprobs, NaN rewards, out-of-vocabulary ids, multi-megabyte payloads, deep nesting).

The reader, on both of its paths (a new reader's newest-first read and the forward poll), adds every good
entry to its buffer and drops every bad one exactly once, by reason, in its own counter and in the cluster's
`dropped` hash that the dashboards show. A training session over such a stream trains on the good samples and
never raises; its losses and weights stay finite (extreme but finite rewards included).

Case counts: printed, and written to test-output/fuzz-cases.json.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from typing import Any

import numpy as np
import torch
from fuzz_helpers import FUZZ, Tally
from hypothesis import given, settings
from hypothesis import strategies as st
from tailspec.core import state
from tailspec.core.config import TrainerConfig
from tailspec.dashboards.snapshot import read_state
from tailspec.drafter_trainer.samples import DROP_PREFIX, SampleBuffer, SampleReader
from tailspec.drafter_trainer.training_session import TrainingSession
from test_trainer_session import frozen_teacher, synthetic_samples

VOCAB, MAX_LEN, VERSION = 64, 48, 5
_clusters = itertools.count()

# -- entries: (acceptable outcomes, XADD fields) -------------------------------------------------------------
# An outcome is "added" or a drop reason; an entry must end in one of its own.
ADDED = "added"


@st.composite
def sample_dicts(draw: Any, vocab: int = VOCAB, max_len: int = MAX_LEN, version: int = VERSION) -> dict:
    """A usable sample: ids in the vocabulary, within max_len, finite reward (extremes included)."""
    n_prompt = draw(st.integers(1, max_len - 1))
    n_resp = draw(st.integers(1, max_len - n_prompt))
    ids = st.integers(0, vocab - 1)
    reward = draw(st.one_of(st.floats(-10, 10), st.sampled_from([0.0, 1.0, 1e308, -1e308, 5e-324])))
    d = {"prompt_ids": draw(st.lists(ids, min_size=n_prompt, max_size=n_prompt)),
         "response_ids": draw(st.lists(ids, min_size=n_resp, max_size=n_resp)),
         "reward": reward, "policy_version": version}
    if draw(st.booleans()):
        d["group_id"] = draw(st.text(max_size=20))
    return d


def dump(d: Any, **kw: Any) -> bytes:
    return json.dumps(d, **kw).encode()


@st.composite
def entries(draw: Any, vocab: int = VOCAB, max_len: int = MAX_LEN, version: int = VERSION
            ) -> tuple[frozenset[str], dict]:
    good = draw(sample_dicts(vocab, max_len, version))
    kind = draw(st.sampled_from([
        "good", "good_pretty", "good_extra_field", "no_data", "binary", "wrong_json_type", "truncated",
        "missing_field", "unknown_field", "wrong_type", "nonfinite_reward", "out_of_vocab", "empty_prompt",
        "empty_response", "too_long", "huge", "deep", "empty_data",
    ]))
    malformed = frozenset({"malformed"})
    if kind == "good":
        return frozenset({ADDED}), {"data": dump(good)}
    if kind == "good_pretty":  # another writer's formatting: still one sample
        return frozenset({ADDED}), {"data": dump(good, indent=draw(st.integers(0, 8)))}
    if kind == "good_extra_field":  # fields other than data are ignored
        return frozenset({ADDED}), {"data": dump(good), draw(st.sampled_from(["junk", "meta"])): draw(st.binary())}
    if kind == "no_data":
        return malformed, {draw(st.sampled_from(["dat", "DATA", "payload", "x"])): draw(st.binary(max_size=50))}
    if kind == "empty_data":
        return malformed, {"data": b""}
    if kind == "binary":
        return malformed, {"data": draw(st.binary(min_size=1, max_size=200))}
    if kind == "wrong_json_type":
        value = draw(st.one_of(st.integers(), st.text(), st.none(), st.booleans(),
                               st.lists(st.integers(), max_size=5), st.just(list(good.values()))))
        return malformed, {"data": dump(value)}
    if kind == "truncated":  # a JSON object cut anywhere before its closing brace never parses
        raw = dump(good)
        return malformed, {"data": raw[: draw(st.integers(0, len(raw) - 1))]}
    if kind == "missing_field":
        good.pop(draw(st.sampled_from(["prompt_ids", "response_ids", "reward", "policy_version"])))
        return malformed, {"data": dump(good)}
    if kind == "unknown_field":  # e.g. logprobs of the wrong length: the schema has no such field at all
        n = len(good["response_ids"]) + draw(st.sampled_from([-1, 1, 100]))
        good[draw(st.sampled_from(["logprobs", "hidden_states", "Reward"]))] = [0.5] * max(n, 0)
        return malformed, {"data": dump(good)}
    if kind == "wrong_type":
        field, value = draw(st.sampled_from([
            ("reward", "high"), ("reward", None), ("reward", [1.0]), ("policy_version", -1),
            ("policy_version", "v5"), ("policy_version", 1.5), ("prompt_ids", "1 2 3"), ("prompt_ids", [1.5]),
            ("response_ids", None), ("response_ids", {"0": 1}), ("group_id", 7), ("ts", "now")]))
        good[field] = value
        return malformed, {"data": dump(good)}
    if kind == "nonfinite_reward":  # json.dumps writes NaN / Infinity, which a lenient parser may take
        good["reward"] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return frozenset({"malformed", "nonfinite_reward"}), {"data": dump(good)}
    if kind == "out_of_vocab":
        i = draw(st.integers(0, len(good["response_ids"]) - 1))
        good["response_ids"][i] = draw(st.sampled_from([vocab, vocab + 7, -1, 2**70]))
        return frozenset({"out_of_vocab"}), {"data": dump(good)}
    if kind == "empty_prompt":
        good["prompt_ids"] = []
        return frozenset({"empty_prompt"}), {"data": dump(good)}
    if kind == "empty_response":
        good["response_ids"] = []
        return frozenset({"empty_response"}), {"data": dump(good)}
    if kind == "too_long":
        good["response_ids"] = [1] * draw(st.integers(max_len, 4 * max_len))
        return frozenset({"oversized"}), {"data": dump(good)}
    if kind == "huge":  # far beyond any usable sample: dropped before parsing
        size = draw(st.sampled_from([100_000, 1 << 20]))
        how = draw(st.sampled_from(["group_id", "ids", "padding"]))
        if how == "group_id":
            good["group_id"] = "x" * size
        elif how == "ids":
            good["prompt_ids"] = [1] * (size // 2)
        raw = dump(good) + (b" " * size if how == "padding" else b"")
        return frozenset({"oversized"}), {"data": raw}
    assert kind == "deep"  # past the JSON parser's recursion limit; the deepest also past the size check
    return frozenset({"malformed", "oversized"}), {"data": b"[" * draw(st.integers(200, 100_000))}


# -- the reader ----------------------------------------------------------------------------------------------
def check_accounting(reader: SampleReader, r, outcomes: list[frozenset[str]]) -> None:
    """Every entry ended exactly once in one of its acceptable outcomes, and Redis counts what the reader did."""
    n_added = sum(1 for o in outcomes if o == {ADDED})
    assert reader.added == n_added, (reader.added, n_added)
    assert sum(reader.dropped.values()) == len(outcomes) - n_added
    only = Counter(next(iter(o)) for o in outcomes if len(o) == 1 and o != {ADDED})
    for reason, n in only.items():
        assert reader.dropped[reason] >= n, (reason, dict(reader.dropped), dict(only))
    allowed = set().union(*outcomes) if outcomes else set()
    assert set(reader.dropped) <= allowed, (dict(reader.dropped), allowed)
    in_redis = {k.decode(): int(v) for k, v in r.hgetall(state.key(reader.cluster, "dropped")).items()}
    assert in_redis == {DROP_PREFIX + k: v for k, v in reader.dropped.items() if v}


def test_reader_drops_and_counts_every_bad_entry(redis_client):
    tally = Tally("samples.stream_entries")

    @given(st.lists(entries(), min_size=1, max_size=12), st.lists(entries(), max_size=12))
    def run(first, later):
        cluster = f"fz{next(_clusters)}"
        key = state.key(cluster, "samples")
        buf = SampleBuffer(capacity=10_000, holdout_fraction=0.25)
        reader = SampleReader(redis_client, cluster, buf, vocab_size=VOCAB, max_seq_len=MAX_LEN)
        good = []
        for batch in (first, later):  # the first poll reads newest-first, the second follows forward
            for outcomes, fields in batch:
                redis_client.xadd(key, fields)
                if outcomes == {ADDED}:
                    good.append(json.loads(fields["data"]))
            reader.poll()
        outcomes = [o for o, _ in first + later]
        check_accounting(reader, redis_client, outcomes)
        kept = sorted((s.prompt_ids, s.response_ids) for s in list(buf.train) + list(buf.holdout))
        assert kept == sorted((g["prompt_ids"], g["response_ids"]) for g in good)
        if buf.train:
            assert np.isfinite(buf.weights()).all(), "a finite reward made a weight NaN/inf"
        tally.add("examples")
        tally.add("entries", len(outcomes))
        tally.add("bad_entries", sum(o != {ADDED} for o in outcomes))
        redis_client.delete(key, state.key(cluster, "dropped"))

    settings(FUZZ, max_examples=200)(run)()
    tally.report(cases="entries")
    assert tally.counts["bad_entries"] > 200


def test_the_dashboards_show_the_drops(redis_client):
    buf = SampleBuffer(capacity=100, holdout_fraction=0.0)
    reader = SampleReader(redis_client, "dash", buf, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    key = state.key("dash", "samples")
    redis_client.xadd(key, {"data": b"{not json"})
    redis_client.xadd(key, {"data": b"x" * (reader.max_entry_bytes + 1)})
    redis_client.xadd(key, {"nodata": b"1"})
    reader.poll()
    view, _ = read_state(redis_client, "dash")
    assert view.dropped == {"trainer_malformed": 2, "trainer_oversized": 1}


def test_an_oversized_entry_is_not_parsed(redis_client, monkeypatch):
    """Megabytes of garbage cost a length check, not a JSON parse."""
    parsed = []
    monkeypatch.setattr(state, "decode", lambda *a, **k: parsed.append(1))
    buf = SampleBuffer(capacity=10)
    reader = SampleReader(redis_client, "big", buf, vocab_size=VOCAB, max_seq_len=MAX_LEN)
    reader.last_id = "0"  # the forward path
    redis_client.xadd(state.key("big", "samples"), {"data": b"[" * (8 << 20)})
    reader.poll()
    assert parsed == [] and reader.dropped == {"oversized": 1}


# -- a training session over a poisoned stream ---------------------------------------------------------------
TEACHER = frozen_teacher()  # vocabulary 21, 4 layers, 128 positions
SESSION_VOCAB, SESSION_LEN = TEACHER.config.vocab_size, 64


@st.composite
def session_entries(draw: Any) -> tuple[frozenset[str], dict]:
    """Bad entries of every kind, and good samples at the edges (single ids, max length, extreme rewards)."""
    if draw(st.booleans()):
        return draw(entries(SESSION_VOCAB, SESSION_LEN, 0).filter(lambda e: e[0] != {ADDED}))
    d = draw(sample_dicts(vocab=SESSION_VOCAB, max_len=SESSION_LEN, version=0))
    return frozenset({ADDED}), {"data": dump(d)}


def test_a_session_over_a_poisoned_stream_trains_and_never_raises(redis_client, tmp_path):
    tally = Tally("samples.training_session")

    @given(st.lists(session_entries(), min_size=3, max_size=12))
    def run(poison):
        cluster = f"fzs{next(_clusters)}"
        key = state.key(cluster, "samples")
        outcomes = []
        for i, s in enumerate(synthetic_samples(12)):
            redis_client.xadd(key, {"data": state.encode(s)})
            outcomes.append(frozenset({ADDED}))
            if i < len(poison):  # outcomes judged for VOCAB / MAX_LEN: here only their number is checked
                o, fields = poison[i]
                redis_client.xadd(key, fields)
                outcomes.append(o)
        buf = SampleBuffer(capacity=1000, holdout_fraction=0.0)
        reader = SampleReader(redis_client, cluster, buf, vocab_size=SESSION_VOCAB, max_seq_len=SESSION_LEN)
        cfg = TrainerConfig(batch_size=4, lr=1e-3, draft_vocab_size=16, max_seq_len=SESSION_LEN,
                            checkpoint_dir=str(tmp_path / cluster))
        session = TrainingSession(cfg, TEACHER, buf, reader=reader, checkpoint_dir=tmp_path / cluster)
        res = session.run(max_steps=2)
        session.close()
        assert res.steps == 2 and all(math.isfinite(x) for x in res.losses), res.losses
        assert all(torch.isfinite(p).all() for p in session.drafter.parameters())
        check_accounting(reader, redis_client, outcomes)
        tally.add("sessions")
        tally.add("bad_entries", sum(o != {ADDED} for o in outcomes))

    settings(FUZZ, max_examples=25)(run)()
    tally.report(cases="sessions")
    assert tally.counts["bad_entries"] >= 25


def test_weights_are_finite_for_any_finite_rewards():
    """The bug the session fuzz found: rewards near float64's limit (±1e308) overflowed the reward weights to
    NaN, and one such sample made the loss NaN."""
    from tailspec.drafter_trainer.weights import reward_weights

    tally = Tally("samples.reward_weights")

    @given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=20),
           st.sampled_from(["reward", "advantage", "uniform"]), st.data())
    def run(rewards, mode, data):
        groups = data.draw(st.lists(st.sampled_from(["a", "b", None]), min_size=len(rewards), max_size=len(rewards)))
        w = reward_weights(rewards, groups, mode)
        assert np.isfinite(w).all() and (w >= 0.1 - 1e-12).all() and (w <= 5.0 + 1e-12).all(), (rewards, w)
        tally.add("cases")

    settings(FUZZ, max_examples=300)(run)()
    tally.report()
