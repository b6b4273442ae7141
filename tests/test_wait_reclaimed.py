"""TailspecClient.wait_reclaimed: the RL trainer waits until every lent GPU is back before its update."""

import threading
import time
import uuid

from tailspec.core import state
from tailspec.core.state import GpuState, GpuStatus, SessionInfo
from tailspec.scheduler.client import TailspecClient


def _cluster() -> str:
    return f"wr-{uuid.uuid4().hex[:8]}"


def _lend(r, cluster, gpu, sid, status="running"):
    r.sadd(state.key(cluster, "gpus"), f"node0:{gpu}")
    state.put(r, state.key(cluster, "gpu_status", node="node0", gpu=gpu),
              GpuStatus(node="node0", gpu=gpu, state=GpuState.LENT, since=time.time(), lease_token=3, session_id=sid))
    r.sadd(state.key(cluster, "sessions"), sid)
    state.put(r, state.key(cluster, "session", session_id=sid),
              SessionInfo(session_id=sid, node="node0", gpu=gpu, lease_token=3, status=status, step=7,
                          started_at=time.time()))


def _give_back(r, cluster, gpu, sid):
    state.put(r, state.key(cluster, "gpu_status", node="node0", gpu=gpu),
              GpuStatus(node="node0", gpu=gpu, state=GpuState.DRAINED, since=time.time()))
    state.put(r, state.key(cluster, "session", session_id=sid),
              SessionInfo(session_id=sid, node="node0", gpu=gpu, lease_token=3, status="stopped", step=7,
                          started_at=time.time(), stopped_at=time.time()))


def test_returns_at_once_when_nothing_is_lent(redis_url, redis_client):
    c = TailspecClient(redis_url, cluster=_cluster())
    try:
        res = c.wait_reclaimed(timeout_s=5)
        assert res.reclaimed and res.held == () and res.waited_s < 1.0
    finally:
        c.close()


def test_waits_for_the_gpu_and_the_session_process(redis_url, redis_client):
    cluster = _cluster()
    _lend(redis_client, cluster, 1, "node0-g1-t1")
    c = TailspecClient(redis_url, cluster=cluster)
    # the GPU counts as reclaimed first (the scheduler's stop deadline), the session process ends later
    def back():
        time.sleep(0.3)
        state.put(redis_client, state.key(cluster, "gpu_status", node="node0", gpu=1),
                  GpuStatus(node="node0", gpu=1, state=GpuState.DRAINED, since=time.time()))
        time.sleep(0.3)
        _give_back(redis_client, cluster, 1, "node0-g1-t1")

    t = threading.Thread(target=back)
    t.start()
    try:
        res = c.wait_reclaimed(timeout_s=10)
        assert res.reclaimed and 0.5 <= res.waited_s < 5, res
    finally:
        t.join()
        c.close()


def test_times_out_naming_the_holder_when_a_session_ignores_its_stop(redis_url, redis_client):
    cluster = _cluster()
    _lend(redis_client, cluster, 2, "node0-g2-t9")
    c = TailspecClient(redis_url, cluster=cluster)
    try:
        res = c.wait_reclaimed(timeout_s=0.4)
        assert not res.reclaimed and res.error is None and 0.4 <= res.waited_s < 3
        assert any("node0:gpu2" in h and "node0-g2-t9" in h for h in res.held), res.held
        assert any("running, step 7" in h for h in res.held), res.held
    finally:
        c.close()


def test_a_gpu_whose_session_has_ended_is_back_before_the_scheduler_marks_it(redis_url, redis_client):
    cluster = _cluster()
    _lend(redis_client, cluster, 1, "node0-g1-t1", status="stopped")  # final record written, GPU still LENT
    _lend(redis_client, cluster, 2, "node0-g2-t2", status="stopped")
    state.put(redis_client, state.key(cluster, "gpu_status", node="node0", gpu=2),  # another session's lease now
              GpuStatus(node="node0", gpu=2, state=GpuState.RECLAIMING, since=time.time(), lease_token=4,
                        session_id="node0-g2-t5"))
    c = TailspecClient(redis_url, cluster=cluster)
    try:
        res = c.wait_reclaimed(timeout_s=0.3)
        assert not res.reclaimed and res.held == ("node0:gpu2 reclaiming by session node0-g2-t5",), res
        state.put(redis_client, state.key(cluster, "gpu_status", node="node0", gpu=2),
                  GpuStatus(node="node0", gpu=2, state=GpuState.DRAINED, since=time.time()))
        assert c.wait_reclaimed(timeout_s=2).reclaimed
    finally:
        c.close()


def test_a_malformed_session_record_is_skipped(redis_url, redis_client):
    cluster = _cluster()
    redis_client.sadd(state.key(cluster, "sessions"), "bad")
    redis_client.set(state.key(cluster, "session", session_id="bad"), b"{not json")
    c = TailspecClient(redis_url, cluster=cluster)
    try:
        assert c.wait_reclaimed(timeout_s=2).reclaimed
    finally:
        c.close()


def test_an_unreachable_redis_returns_at_once_with_the_error():
    c = TailspecClient("redis://127.0.0.1:1/0", cluster=_cluster(), timeout_s=0.2)
    try:
        res = c.wait_reclaimed(timeout_s=30)
        assert not res.reclaimed and res.error and res.waited_s < 10
    finally:
        c.close(flush_s=0.1)


def test_a_session_that_released_its_gpu_is_back_while_it_merges(redis_url, redis_client):
    """A session frees its GPU before its last merge (drafter_trainer/training_session.py: Giving the GPU back) and says so
    (`released_at`): the trainer does not wait for the merge; the same record without it is waited for."""
    cluster = _cluster()
    _lend(redis_client, cluster, 1, "node0-g1-t1", status="stopping")
    c = TailspecClient(redis_url, cluster=cluster)
    try:
        res = c.wait_reclaimed(timeout_s=0.3)
        assert not res.reclaimed and any("stopping" in h for h in res.held), res
        key = state.key(cluster, "session", session_id="node0-g1-t1")
        info = state.get(redis_client, key, SessionInfo)
        state.put(redis_client, key, info.model_copy(update={"released_at": time.time()}))
        res = c.wait_reclaimed(timeout_s=5)
        assert res.reclaimed and res.waited_s < 1.0, res
    finally:
        c.close()


def test_a_poll_reads_only_the_sessions_not_seen_to_end(redis_url, redis_client):
    """The sessions set names every session of the run; an ended one is read once, so a poll's cost does not grow
    with the run's age. A session started later is seen at the next poll, and one reusing a cleared set's id is
    not taken for ended."""
    from tailspec.scheduler.held import HeldReader

    cluster = _cluster()
    for i in range(200):
        _lend(redis_client, cluster, i % 4, f"node0-g{i % 4}-t{i}")
        _give_back(redis_client, cluster, i % 4, f"node0-g{i % 4}-t{i}")
    reader = HeldReader(redis_client, cluster)
    assert reader.held() == [] and reader.records_read == 200
    assert reader.held() == [] and reader.records_read == 200  # nothing live: no record read again
    _lend(redis_client, cluster, 2, "node0-g2-t200")
    assert reader.held() == ["node0:gpu2 held by session node0-g2-t200 (running, step 7)",
                             "node0:gpu2 lent by session node0-g2-t200"]
    assert reader.records_read == 201
    assert len(reader.held()) == 2 and reader.records_read == 202  # the live one, again
    _give_back(redis_client, cluster, 2, "node0-g2-t200")
    assert reader.held() == [] and reader.records_read == 203
    # the cluster's state cleared and the ids counted from 1 again: a running t1 is not the ended t1 of before
    for key in redis_client.scan_iter(f"*{cluster}*"):
        redis_client.delete(key)
    _lend(redis_client, cluster, 1, "node0-g1-t1")
    assert reader.held() == ["node0:gpu1 held by session node0-g1-t1 (running, step 7)",
                             "node0:gpu1 lent by session node0-g1-t1"]
