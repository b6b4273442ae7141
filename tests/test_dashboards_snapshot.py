"""The dashboards' reader: snapshot figures and the per-GPU timeline, against hand-computed values."""

from __future__ import annotations

import itertools
import time

import pytest
from tailspec.core import state as S
from tailspec.core.state import GpuState, GpuTelemetry
from tailspec.dashboards.snapshot import (
    HistoryCache,
    Reader,
    StreamCache,
    _telemetry_row,
    read_state,
    read_timeline,
    reclaimed_share,
)
from test_dashboards_writer import GiB, StateWriter


def test_rollout_speedup_and_strategy_figures(redis_client):
    w = StateWriter(redis_client)
    w.rollout("w0", 1, tokens=12_000, seconds=6.0, forwards=4000, mix={"0": 1, "4": 3}, baseline_tps=1000.0)
    w.rollout("w0", 2, tokens=9_000, seconds=3.0, forwards=3000, mix={"4": 4})  # no baseline measured
    view, _ = read_state(redis_client, "t")
    p1, p2 = view.rollout
    assert (p1.step, p1.tokens_per_s, p1.speedup, p1.acceptance_length) == (1, 2000.0, 2.0, 3.0)
    assert p2.tokens_per_s == 3000.0 and p2.speedup is None
    assert p1.strategy_mix == {"0": 1, "4": 3}


def test_reclaimed_share_bounds():
    assert reclaimed_share(0.0, 0.0) is None
    assert reclaimed_share(10.0, 2.5) == 0.25
    assert reclaimed_share(10.0, 12.0) == 1.0  # clock skew between writers never shows > 100 %


def test_timeline_segments_match_transitions(redis_client):
    w = StateWriter(redis_client)
    now = time.time()
    w.telemetry(0, 50.0, GiB)
    w.telemetry(1, 50.0, GiB)
    w.telemetry(2, 0.0, 0, error="NVML_ERROR_GPU_IS_LOST")  # telemetry only: no scheduler state
    # GPU 0: generating → drained → lent → reclaiming → generating inside a 40 s window
    for st, ago in [(GpuState.GENERATING, 50), (GpuState.DRAINED, 30), (GpuState.LENT, 20),
                    (GpuState.RECLAIMING, 6), (GpuState.GENERATING, 5)]:
        w.status(0, st, since=now - ago)
    # GPU 1: one transition long before the window
    w.status(1, GpuState.GENERATING, since=now - 1000)
    tl = read_timeline(redis_client, "t", window_s=40.0)
    lanes = {lane.id: lane for lane in tl.gpus}
    assert list(lanes) == ["node0:0", "node0:1", "node0:2"]
    got = [(s.state, round(s.start - tl.start, 1), round(tl.now - s.end, 1)) for s in lanes["node0:0"].segments]
    off = round(tl.now - now, 1)  # read a few ms after `now`
    assert [g[0] for g in got] == [GpuState.GENERATING, GpuState.DRAINED, GpuState.LENT, GpuState.RECLAIMING,
                                   GpuState.GENERATING]
    assert got[0][1] == 0.0  # the state at window start comes from the transition before it
    assert [round(s.end - s.start, 1) for s in lanes["node0:0"].segments[1:4]] == [10.0, 14.0, 1.0]
    assert lanes["node0:0"].segments[-1].open and got[-1][2] == 0.0
    assert round(tl.now - lanes["node0:0"].segments[-1].start, 1) == round(5 + off, 1)
    # segments tile the window: consecutive, no gaps, no overlap
    for lane in tl.gpus[:2]:
        segs = lane.segments
        assert segs[0].start == tl.start and segs[-1].end == tl.now
        assert all(a.end == b.start for a, b in itertools.pairwise(segs))
    assert [(s.state, s.open) for s in lanes["node0:1"].segments] == [(GpuState.GENERATING, True)]
    assert lanes["node0:2"].segments == []  # never had a scheduler state: nothing recorded, nothing drawn
    # a GPU first seen inside the window: its lane starts at its first transition
    w.status(3, GpuState.DRAINED, since=now - 12)
    w.status(3, GpuState.LENT, since=now - 2)
    lane = {lane.id: lane for lane in read_timeline(redis_client, "t", window_s=40.0).gpus}["node0:3"]
    assert [(s.state, round(s.end - s.start)) for s in lane.segments] == [(GpuState.DRAINED, 10), (GpuState.LENT, 2)]


def test_timeline_telemetry_series_and_downsampling(redis_client):
    w = StateWriter(redis_client)
    now = time.time()
    for i in range(50):
        w.telemetry(0, float(i), i * GiB, ts=now - 50 + i)
    w.telemetry(1, 7.0, GiB, ts=now - 100)  # before the window
    tl = read_timeline(redis_client, "t", window_s=60.0)
    assert [s.id for s in tl.telemetry] == ["node0:0"]
    s = tl.telemetry[0]
    assert s.util == [float(i) for i in range(50)] and s.mem_used[-1] == 49 * GiB and s.simulated
    small = read_timeline(redis_client, "t", window_s=60.0, max_points=10)
    s = small.telemetry[0]
    assert len(s.ts) <= 10 and s.util[-1] == 49.0  # the newest point survives downsampling
    assert s.ts == sorted(s.ts)


def test_window_is_validated(redis_client):
    for bad in (0.5, 0.0, -3.0, 1e9, float("nan")):
        with pytest.raises(ValueError, match="window must be in"):
            read_timeline(redis_client, "t", window_s=bad)


def test_malformed_entries_are_counted_and_skipped(redis_client):
    w = StateWriter(redis_client)
    w.cycle(0, "generating")
    w.cycle(1, "generating")
    redis_client.set(S.key("t", "gpu_status", node="node0", gpu=1), b'{"node":"node0","gpu":1,"state":"asleep"}')
    redis_client.xadd(S.key("t", "status_history"), {"data": b"\x80\x04not json"})
    redis_client.xadd(S.key("t", "rollout_stats"), {"data": b'{"worker": 3}'})
    redis_client.hset(S.key("t", "counters"), "lent_gpu_seconds", b"lots")
    redis_client.sadd(S.key("t", "sessions"), "ghost")  # id without a record: ignored, not an error
    view, _ = read_state(redis_client, "t")
    assert [(g.id, g.state) for g in view.gpus] == [("node0:0", GpuState.GENERATING), ("node0:1", GpuState.UNKNOWN)]
    assert view.gpus[1].util == 95.0  # the good telemetry of the same GPU still shows
    assert view.rollout == [] and view.counters.lent_gpu_seconds == 0.0
    assert view.bad_payloads == 3
    tl = read_timeline(redis_client, "t", window_s=60)
    assert tl.bad_payloads == 2  # gpu_status of GPU 1 and the stream entry
    assert [s.state for s in tl.gpus[0].segments][-1] == GpuState.GENERATING


def test_empty_cluster_reads_cleanly(redis_client):
    view, sessions = read_state(redis_client, "nothing-here")
    assert view.gpus == [] and sessions == [] and view.phase is None and not view.simulated
    assert view.counters.reclaimed_share is None
    tl = read_timeline(redis_client, "nothing-here", window_s=10)
    assert tl.gpus == [] and tl.telemetry == []


def _direct(redis_client, start_ms: int) -> list[tuple]:
    """Reference: the telemetry rows of a plain XRANGE from start_ms, decoded."""
    rd = Reader(redis_client, "t")
    return [_telemetry_row(p, t) for t, p in rd._stream("telemetry_history", GpuTelemetry, start_ms=start_ms)]


def test_incremental_history_cache_matches_a_full_read(redis_client):
    w = StateWriter(redis_client)
    cache = StreamCache("telemetry_history", GpuTelemetry, _telemetry_row)
    rd = Reader(redis_client, "t")
    t0_ms = int(time.time() * 1000)
    assert cache.read(rd, t0_ms - 60_000) == []  # no stream yet
    for i in range(5):
        w.telemetry(i % 2, float(i), i * GiB)
    assert cache.read(rd, t0_ms - 60_000) == _direct(redis_client, t0_ms - 60_000)
    for poll in range(4):  # polls with new entries in between, and one with none
        for i in range(poll * 3):
            w.telemetry(i % 2, float(10 * poll + i), GiB)
        got = cache.read(rd, t0_ms - 60_000)
        assert got == _direct(redis_client, t0_ms - 60_000) and len(got) == 5 + 3 * sum(range(poll + 1))
    # a shorter window is a suffix, a longer one fetches the older part once
    time.sleep(0.01)
    mid_ms = int(time.time() * 1000)
    w.telemetry(0, 99.0, GiB)
    assert cache.read(rd, mid_ms) == _direct(redis_client, mid_ms)
    assert cache.read(rd, t0_ms - 600_000) == _direct(redis_client, t0_ms - 600_000)
    # a malformed entry is counted when first read, not on every poll
    redis_client.xadd(S.key("t", "telemetry_history"), {"data": b"junk"})
    rd1 = Reader(redis_client, "t")
    cache.read(rd1, t0_ms - 60_000)
    rd2 = Reader(redis_client, "t")
    cache.read(rd2, t0_ms - 60_000)
    assert (rd1.bad, rd2.bad) == (1, 0)
    # the stream recreated (Redis restarted, key deleted): the cache starts over instead of waiting for old ids
    redis_client.delete(S.key("t", "telemetry_history"))
    assert cache.read(rd, t0_ms - 60_000) == []
    redis_client.xadd(S.key("t", "telemetry_history"), {"data": b"junk"}, id="1-1")
    w.telemetry(1, 1.0, GiB)
    assert cache.read(rd, 0) == _direct(redis_client, 0) and len(cache.read(rd, 0)) == 1


def test_cached_timeline_equals_uncached(redis_client):
    w = StateWriter(redis_client)
    now = time.time()
    cache = HistoryCache()
    for poll in range(3):
        for g in range(2):
            w.telemetry(g, 10.0 * poll + g, GiB, ts=now - 30 + poll)
            w.status(g, [GpuState.GENERATING, GpuState.DRAINED, GpuState.LENT][poll], since=now - 30 + 5 * poll + g)
        a = read_timeline(redis_client, "t", window_s=120, cache=cache)
        b = read_timeline(redis_client, "t", window_s=120)
        assert [[(s.state, round(s.start, 3)) for s in lane.segments] for lane in a.gpus] == \
            [[(s.state, round(s.start, 3)) for s in lane.segments] for lane in b.gpus]
        assert [(s.id, s.ts, s.util) for s in a.telemetry] == [(s.id, s.ts, s.util) for s in b.telemetry]


def test_a_transition_without_a_time_is_dated_by_its_stream_entry(redis_client):
    w = StateWriter(redis_client)
    w.telemetry(0, 1.0, GiB)
    t0 = time.time()
    S.put(redis_client, S.key("t", "gpu_status", node="node0", gpu=0),
          S.GpuStatus(node="node0", gpu=0, state=GpuState.UNKNOWN, since=0.0))
    S.append(redis_client, S.key("t", "status_history"), S.GpuStatus(node="node0", gpu=0, state=GpuState.UNKNOWN,
                                                                       since=0.0))
    view, _ = read_state(redis_client, "t")
    assert view.gpus[0].state_since is None  # not "56 years ago"
    for cache in (None, HistoryCache()):
        tl = read_timeline(redis_client, "t", window_s=600, cache=cache)
        (seg,) = tl.gpus[0].segments
        assert seg.state == GpuState.UNKNOWN and abs(seg.start - t0) < 1.0  # not the window start


def test_a_session_cache_reads_each_ended_session_once_and_reads_the_same(redis_client):
    """A long-lived reader keeps the ended sessions' records: a refresh reads only the others, and sees what an
    uncached read sees (a running session's progress, a new session, an end); a cleared set empties the cache."""
    from tailspec.dashboards.snapshot import SessionCache

    cl = "sc"

    def put(i: int, status: str, step: int = 9) -> None:
        sid = f"node0-g{i % 2}-t{i}"
        redis_client.sadd(S.key(cl, "sessions"), sid)
        S.put(redis_client, S.key(cl, "session", session_id=sid),
              S.SessionInfo(session_id=sid, node="node0", gpu=i % 2, lease_token=i + 1, status=status, step=step,
                            started_at=float(i), stopped_at=None if status == "running" else i + 0.5))

    for i in range(30):
        put(i, "stopped" if i % 3 else "failed")
    put(30, "running", step=1)
    cache = SessionCache()
    reads: list[int] = []
    mget = redis_client.mget

    def counting_mget(keys, *args):
        reads.append(len(keys))
        return mget(keys, *args)

    redis_client.mget = counting_mget
    try:
        def both() -> tuple[list, list]:
            cached = read_state(redis_client, cl, sessions_limit=None, cache=cache)[1]
            plain = read_state(redis_client, cl, sessions_limit=None)[1]
            return cached, plain

        reads.clear()
        cached, plain = both()
        assert cached == plain and len(cached) == 31 and 31 in reads
        put(30, "running", step=5)  # the running session moves on: read again
        put(31, "running", step=1)  # a new one
        reads.clear()
        cached, plain = both()
        assert cached == plain and cached[0].session_id == "node0-g1-t31" and cached[1].step == 5
        assert 2 in reads and 30 not in reads  # the cached read fetched the two running sessions only
        put(30, "stopped", step=7)
        assert both()[0] == both()[1]
        for key in redis_client.scan_iter(f"*{cl}*"):  # the state cleared, ids counted from 0 again
            redis_client.delete(key)
        put(0, "running", step=2)
        cached, plain = both()
        assert cached == plain and [(s.session_id, s.status) for s in cached] == [("node0-g0-t0", "running")]
    finally:
        del redis_client.mget
