"""Bad input, fuzzed: every TailspecClient call gets wrong types, NaN/inf, negative and huge numbers, empty and
non-UTF-8 strings, unknown and negative GPUs, huge id lists. Each call either accepts and the value lands in
Redis exactly (decoded back, field by field), or refuses with ValueError/TypeError naming the argument and
leaves Redis as it was. Anything else (another exception, a stalled writer thread) fails.

Case counts: printed, and written to test-output/fuzz-cases.json.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from fuzz_helpers import FUZZ, Tally, bad, draw_args, either, good, judge
from hypothesis import given, settings
from hypothesis import strategies as st
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.state import MAX_WORKER_GPUS, NAME_PATTERN, PhaseInfo, Progress, Sample
from tailspec.scheduler.client import TailspecClient
from tailspec.scheduler.client_checks import MAX_SAMPLE_IDS
from tailspec.scheduler.service import Scheduler

CL = "fz"
NAN, INF = float("nan"), float("inf")

# -- value pools ---------------------------------------------------------------------------------------------
names = st.from_regex(NAME_PATTERN, fullmatch=True)
texts = st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_./:@ -]{0,30}", fullmatch=True),
                  st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=12))
bad_texts = st.one_of(st.sampled_from(["", "   ", "a\ud800b", "tab\there", "new\nline", "x" * 5000]),
                      st.integers(), st.none(), st.just(b"bytes"), st.just(["w0"]))
counts = st.integers(0, 2**62)
bad_counts = st.one_of(st.integers(max_value=-1), st.sampled_from([NAN, INF, -INF, 2.5, "many", [1], {}]),
                       st.just(object()))
int_like = st.sampled_from(["3", 7.0, True])  # pydantic's lax mode stores 3, 7, 1


def as_int(v: Any) -> int:
    return int(v)


def gpu_lists() -> st.SearchStrategy:
    ints = st.integers(0, 2**40)  # unknown GPUs (no telemetry names them) are accepted; the scheduler never lends them
    return st.one_of(st.lists(ints, max_size=8), st.lists(ints, max_size=4).map(tuple),
                     st.lists(st.integers(0, 7), max_size=4).map(np.array))


bad_gpus = st.one_of(
    st.lists(st.integers(max_value=-1), min_size=1, max_size=3).map(lambda xs: [0] + xs),
    st.sampled_from(["01", b"0", {"0": 1}, None, 3, [0.5], ["a"], [NAN], list(range(MAX_WORKER_GPUS + 1))]),
)

PROGRESS = {
    "worker": (good(texts), bad(bad_texts)),
    "gpus": (good(gpu_lists(), lambda v: [int(x) for x in v]), bad(bad_gpus)),
    "active": (st.one_of(good(counts), either(int_like, as_int)), bad(bad_counts)),
    "finished": (good(counts), bad(bad_counts)),
    "phase": (good(st.sampled_from(["idle", "rollout", "train"])),
              bad(st.sampled_from(["generate", "", "ROLLOUT", None, 1]))),
    "total": (good(counts), bad(bad_counts)),
    "step": (st.one_of(good(counts), good(st.none(), lambda v: 0)), bad(bad_counts)),
    "tokens_done": (good(counts), bad(bad_counts)),
    "tokens_per_s": (good(st.floats(0, 1e12)), bad(st.sampled_from([NAN, INF, -1.0, "fast", None,
                                                                    np.float32("inf")]))),
    "remaining_s": (good(st.none() | st.floats(0, 1e9)), bad(st.sampled_from([-1.0, NAN, INF, "soon"]))),
    "node": (good(st.none() | names, lambda v: v or "node0"),
             bad(st.sampled_from(["", "a:b", "x" * 65, "nöde", "has space", 5, b"n"]))),
    "mem_released": (good(st.none() | st.booleans()), bad(st.sampled_from(["maybe", 2, 0.5, [True]]))),
    "free_mem": (good(st.none() | st.integers(0, 2**50)), bad(st.sampled_from([-1, NAN, "lots", 1.5]))),
}

PHASE = {
    "phase": PROGRESS["phase"],
    "step": (good(counts), bad(bad_counts)),
    "policy_version": (st.one_of(good(counts), either(int_like, as_int)), bad(bad_counts)),
    "policy_path": (good(st.none() | texts), bad(bad_texts.filter(lambda v: v is not None))),
}

ids = st.lists(st.integers(-10, 2**31), min_size=0, max_size=12)  # the client does not know the vocabulary
SAMPLE = {
    "prompt_ids": (good(ids), bad(st.sampled_from([None, "1 2 3", [1.5], ["a"], 7, [1] * (MAX_SAMPLE_IDS + 1)]))),
    "response_ids": (good(ids), bad(st.sampled_from([None, {"a": 1}, [NAN], [None]]))),
    "reward": (good(st.floats(-1e6, 1e6) | st.integers(-5, 5)),
               bad(st.sampled_from([NAN, INF, -INF, "high", None, [1.0], np.float64("nan")]))),
    "policy_version": PHASE["policy_version"],
    "group_id": (good(st.none() | texts), bad(st.sampled_from([5, ["g"], "g\ud800", "x" * 5000]))),
    "ts": (good(st.floats(0, 4e9)), bad(st.sampled_from([NAN, INF, "now", None]))),
    "logprobs": (good(st.just(None)), bad(st.sampled_from([[0.1, -0.2], [], "x"]))),  # not a Sample field
}


# -- fixtures and snapshots ----------------------------------------------------------------------------------
@pytest.fixture
def client(redis_url):
    # every policy version kept: the stream is trimmed by version otherwise, which would hide what was written
    c = TailspecClient(redis_url, cluster=CL, progress_ttl_s=600.0, queue_size=100_000, samples_keep_versions=10**9)
    yield c
    c.close()


def snapshot(r) -> dict[bytes, Any]:
    """Every key of the cluster with its content (strings, sets, hashes, streams: whole)."""
    keys = sorted(r.scan_iter(match=state.prefix(CL) + "*", count=1000))
    pipe = r.pipeline(transaction=True)  # one round trip: the snapshot is consistent and cheap per example
    for k in keys:
        pipe.type(k)
    types = pipe.execute()
    for k, t in zip(keys, types):
        {b"string": pipe.get, b"set": pipe.smembers, b"hash": pipe.hgetall, b"stream": pipe.xrange}[t](k)
    return dict(zip(keys, pipe.execute()))


def assert_unchanged(client: TailspecClient, r, before: dict) -> None:
    assert client.flush(5), "client did not flush"
    assert snapshot(r) == before, "a refused call changed Redis"


# -- the fuzz tests ------------------------------------------------------------------------------------------
class NoSessions:
    """A dispatcher that starts nothing: the scheduler's tick is what is under test."""

    def start(self, ctx) -> None: ...
    def stop(self, session_id: str) -> None: ...
    def cancel(self, session_id: str) -> None: ...
    def poll(self) -> set[str]:
        return set()
    def forget(self, session_id: str) -> None: ...
    def shutdown(self) -> None: ...


def scheduler(redis_url: str, r) -> Scheduler:
    cfg = TailspecConfig()
    cfg.cluster.name, cfg.cluster.redis_url = CL, redis_url
    return Scheduler(cfg, r, NoSessions(), redis_url=redis_url)


def test_report_progress(client, redis_client, redis_url):
    """Accepted reports are stored exactly and the scheduler's tick reads them (no payload it skips, no raise)."""
    tally = Tally("client.report_progress")
    sched = scheduler(redis_url, redis_client)

    @given(st.data())
    def run(data):
        args = draw_args(data, PROGRESS)
        assert client.flush(5)
        before = snapshot(redis_client)
        accepted, _ = judge(client.report_progress, args, tally)
        if not accepted:
            assert_unchanged(client, redis_client, before)
            return
        assert client.flush(5)
        worker = args["worker"].value
        p = state.get(redis_client, state.key(CL, "progress", worker=worker), Progress)
        assert p is not None, "accepted progress not stored"
        for name, a in args.items():
            assert getattr(p, name) == a.expect, (name, getattr(p, name), a.expect)
        assert worker.encode() in redis_client.smembers(state.key(CL, "workers"))
        assert redis_client.pttl(state.key(CL, "progress", worker=worker)) > 0
        sched.tick()
        assert sched.bad_payloads == 0 and sched.errors == 0

    _run(run, 250)
    tally.report()
    assert tally.counts.get("accepted") and tally.counts.get("refused")
    assert client.errors == 0, "the writer thread failed on accepted input"
    assert sched.ticks == tally.counts["accepted"]


def test_a_negative_gpu_written_around_the_client_is_skipped_by_the_scheduler(redis_client, redis_url):
    """The bug the fuzz found: Progress allowed gpus=[-1]; the scheduler made a state machine for it and failed
    every tick from then on building its GpuStatus (gpu >= 0). Now the record is a bad payload, counted."""
    now = time.time()
    good = Progress(worker="w0", node="node0", gpus=[0], active=1, finished=0, phase="rollout", ts=now)
    records = {"w0": state.encode(good),
               "w1": good.model_dump_json().replace('"gpus":[0]', '"gpus":[-1]').replace("w0", "w1"),
               "w2": good.model_dump_json().replace('"gpus":[0]', f'"gpus":{list(range(MAX_WORKER_GPUS + 1))}')}
    for w, raw in records.items():
        redis_client.set(state.key(CL, "progress", worker=w), raw)
        redis_client.sadd(state.key(CL, "workers"), w)
    sched = scheduler(redis_url, redis_client)
    for _ in range(3):
        sched.tick()
    assert sched.bad_payloads == 6 and sched.errors == 0
    assert state.get(redis_client, state.key(CL, "gpu_status", node="node0", gpu=0), state.GpuStatus) is not None
    assert redis_client.keys(state.key(CL, "gpu_status", node="*", gpu="-1")) == []


def test_set_phase(client, redis_client):
    tally = Tally("client.set_phase")
    events = state.key(CL, "events")

    @given(st.data())
    def run(data):
        args = draw_args(data, PHASE)
        assert client.flush(5)
        before = snapshot(redis_client)
        n_events = redis_client.xlen(events)
        accepted, _ = judge(client.set_phase, args, tally)
        if not accepted:
            assert_unchanged(client, redis_client, before)
            return
        assert client.flush(5)
        ph = state.get(redis_client, state.key(CL, "phase"), PhaseInfo)
        for name, a in args.items():
            assert getattr(ph, name) == a.expect, (name, getattr(ph, name), a.expect)
        assert redis_client.xlen(events) == n_events + 1

    _run(run, 200)
    tally.report()
    assert tally.counts.get("accepted") and tally.counts.get("refused")
    assert client.errors == 0


def sample_dicts(data) -> tuple[list[dict], list[dict[str, Any]], set[str], set[str]]:
    """1-4 samples as dicts (a bad field in some) → (dicts, expected stored fields, bad fields, either fields)."""
    n = data.draw(st.integers(1, 4), label="n_samples")
    dicts, expects, any_bad, maybe = [], [], set(), set()
    for _ in range(n):
        args = draw_args(data, SAMPLE, max_bad=1)
        d = {k: a.value for k, a in args.items() if not (k == "logprobs" and a.value is None)}
        dicts.append(d)
        expects.append({k: a.expect for k, a in args.items() if k != "logprobs"})
        any_bad |= {k for k, a in args.items() if a.tag == "bad"}
        maybe |= {k for k, a in args.items() if a.tag == "either"}
    return dicts, expects, any_bad, maybe


def test_submit_samples(client, redis_client):
    tally = Tally("client.submit_samples")
    key = state.key(CL, "samples")

    @given(st.data())
    def run(data):
        dicts, expects, bad_fields, maybe = sample_dicts(data)
        as_models = data.draw(st.booleans(), label="as_models") and not bad_fields
        payload: Any = [Sample(**d) for d in dicts] if as_models else dicts
        assert client.flush(5)
        before = redis_client.xlen(key)
        try:
            accepted = client.submit_samples(payload)
        except (ValueError, TypeError) as e:
            assert bad_fields or maybe, f"valid samples refused: {e}"
            assert any(f in str(e).split("(got")[0] for f in bad_fields | maybe), (bad_fields, str(e)[:300])
            tally.add("refused")
            assert client.flush(5)
            assert redis_client.xlen(key) == before, "a refused call wrote samples"
            return
        assert not bad_fields, f"accepted samples with bad {bad_fields}"
        tally.add("accepted")
        assert accepted == len(dicts)
        assert client.flush(5)
        got = redis_client.xrevrange(key, count=len(dicts))[::-1]
        assert redis_client.xlen(key) == before + len(dicts)
        for (_, fields), want in zip(got, expects):
            s = state.decode(Sample, fields[b"data"])
            for name, v in want.items():
                assert getattr(s, name) == v, (name, getattr(s, name), v)

    _run(run, 200)
    tally.report()
    assert tally.counts.get("accepted") and tally.counts.get("refused")
    assert client.errors == 0


@pytest.mark.parametrize("payload", ["abc", b"abc", {"prompt_ids": [1]}, None, 5, 2.5,
                                     Sample(prompt_ids=[1], response_ids=[2], reward=1.0, policy_version=0)])
def test_submit_samples_refuses_a_non_list(client, payload):
    with pytest.raises(TypeError, match="samples"):
        client.submit_samples(payload)


def test_samples_changed_after_validation_are_checked_again(client, redis_client):
    s = Sample(prompt_ids=[1], response_ids=[2], reward=1.0, policy_version=0)
    s.reward = NAN  # a Sample is not validated on assignment
    with pytest.raises(ValueError, match=r"samples\[0\]\.reward"):
        client.submit_samples([s])
    assert client.flush(5) and redis_client.xlen(state.key(CL, "samples")) == 0


def test_a_huge_sample_inside_the_cap_is_stored_whole(client, redis_client):
    big = list(range(200_000))
    assert client.submit_samples([{"prompt_ids": big, "response_ids": [1], "reward": 0.0, "policy_version": 1}]) == 1
    assert client.flush(10)
    (_, fields), = redis_client.xrange(state.key(CL, "samples"))
    assert state.decode(Sample, fields[b"data"]).prompt_ids == big


SECONDS = (good(st.floats(0, 0.02) | st.just(0)), bad(st.sampled_from([-1.0, NAN, INF, "1", None, True])))


def test_waiting_calls(client):
    tally = Tally("client.waits")

    @given(st.data())
    def run(data):
        which = data.draw(st.sampled_from(["current_drafter", "wait_reclaimed", "flush"]))
        if which == "current_drafter":
            accepted, out = judge(client.current_drafter, draw_args(data, {"wait_s": SECONDS}), tally)
            assert not accepted or out is None
        elif which == "flush":
            judge(client.flush, draw_args(data, {"timeout_s": SECONDS}), tally)
        else:
            poll = (good(st.floats(0.001, 0.02)), bad(st.sampled_from([0, -0.1, NAN, INF, "x"])))
            accepted, out = judge(client.wait_reclaimed, draw_args(data, {"timeout_s": SECONDS, "poll_s": poll}),
                                  tally)
            assert not accepted or (out.reclaimed and out.error is None)

    _run(run, 120)
    tally.report()
    assert tally.counts.get("accepted") and tally.counts.get("refused")


def test_constructor(redis_url):
    tally = Tally("client.__init__")
    threads = threading.active_count()
    urls = st.sampled_from([redis_url, "redis://127.0.0.1:1/0", "unix:///nonexistent/redis.sock",
                            redis_url.replace("redis://", "redis://:pw@")])
    spec = {
        "redis_url": (good(urls), bad(st.sampled_from(["", "http://127.0.0.1:6379", "127.0.0.1:6379", 6379, None,
                                                       "redis://127.0.0.1:port/0"]))),
        "cluster": (good(names), bad(st.sampled_from(["", "a:b", "x" * 65, None, 3, "tailspec:{c}"]))),
        "node": (good(names), bad(st.sampled_from(["", "n:0", " n", None]))),
        "queue_size": (good(st.integers(1, 10**9)), bad(st.sampled_from([0, -1, 1.5, "10", None, True]))),
        "progress_ttl_s": (good(st.floats(0.01, 60)), bad(st.sampled_from([0, -1.0, NAN, INF, "5"]))),
        "timeout_s": (good(st.floats(0.01, 0.1)), bad(st.sampled_from([0.0, -0.5, NAN, INF, None]))),
        "refresh_s": (good(st.floats(0.01, 5)), bad(st.sampled_from([0, -1, NAN, "x"]))),
        "samples_maxlen": (good(st.integers(1, 10**9)), bad(st.sampled_from([0, -5, 2.0, "x"]))),
        "samples_keep_versions": (good(st.integers(1, 100)), bad(st.sampled_from([0, -1, None]))),
    }

    @given(st.data())
    def run(data):
        before = threading.active_count()
        accepted, c = judge(TailspecClient, draw_args(data, spec), tally)
        if accepted:
            c.close(flush_s=0.0)
        assert threading.active_count() <= before, "a client left a thread behind"

    _run(run, 60)
    tally.report()
    assert tally.counts.get("accepted") and tally.counts.get("refused")
    assert threading.active_count() <= threads


def _run(test, n: int) -> None:
    """Run a @given test with max_examples=n (the FUZZ settings otherwise)."""
    settings(FUZZ, max_examples=n)(test)()


def test_nan_is_never_written_as_null(client, redis_client):
    """The bug the fuzz found: NaN/inf passed pydantic and reached Redis as null, which the trainer refuses."""
    for bad_call in (lambda: client.report_progress("w", [0], 0, 1, tokens_per_s=INF),
                     lambda: client.report_progress("w", [0], 0, 1, remaining_s=INF),
                     lambda: client.submit_samples([{"prompt_ids": [1], "response_ids": [2], "reward": NAN,
                                                     "policy_version": 0}])):
        with pytest.raises(ValueError, match="finite"):
            bad_call()
    assert client.flush(5)
    assert snapshot(redis_client) == {}
