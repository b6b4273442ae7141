"""Warm session processes: a lent GPU is handed to a pre-started process that already imported its entry."""

import json
import time

from tailspec.scheduler.dispatch import LocalDispatcher, warm_ready
from tailspec.scheduler.session_process import SessionContext


def _ctx(redis_url, sid, gpu):
    return SessionContext(session_id=sid, node="n0", gpu=gpu, lease_token=1, redis_url=redis_url, cluster="w",
                          require_heartbeat=False)


def _wait_ended(d: LocalDispatcher, sid: str, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while sid not in d.poll() and time.time() < deadline:
        time.sleep(0.05)


def test_warm_process_runs_the_assigned_session_with_its_gpu(tmp_path, redis_url):
    entry = "tailspec.scheduler.busy_sessions:env_probe_session"
    d = LocalDispatcher(entry, log_dir=str(tmp_path), warm=1, extra_env={"TAILSPEC_PROBE_DIR": str(tmp_path)})
    try:
        assert len(d._warm) == 1
        warm_pid = d._warm[0][0].pid
        time.sleep(1.0)  # let it import
        d.start(_ctx(redis_url, "s-warm", gpu=3))
        assert d.pid("s-warm") == warm_pid  # the pre-started process took the session
        assert d._warm == []  # a pool of one: its process is busy, none imports meanwhile
        _wait_ended(d, "s-warm")
        assert d.ended.get("s-warm") == 0
        assert [p.pid for p, _ in d._warm] == [warm_pid]  # back in the pool for the next lend
        out = json.loads((tmp_path / "probe-s-warm.json").read_text())
        assert out["CUDA_VISIBLE_DEVICES"] == "3"
    finally:
        d.shutdown()
    assert not d._warm and not d.procs


def test_warm_process_exits_quietly_on_eof(tmp_path):
    d = LocalDispatcher("tailspec.scheduler.busy_sessions:env_probe_session", log_dir=str(tmp_path), warm=2)
    procs = [p for p, _ in d._warm]
    d.shutdown()
    assert all(p.poll() == 0 for p in procs)


def test_session_nice_applies_to_warm_and_cold_sessions(tmp_path, redis_url):
    """scheduler.session_nice: simulated GPUs share the host's cores, so sessions yield CPU to rollouts."""
    import os

    base = os.nice(0)
    entry = "tailspec.scheduler.busy_sessions:env_probe_session"
    for warm in (1, 0):
        d = LocalDispatcher(entry, log_dir=str(tmp_path), warm=warm, nice=7,
                            extra_env={"TAILSPEC_PROBE_DIR": str(tmp_path)})
        sid = f"s-nice-{warm}"
        try:
            d.start(_ctx(redis_url, sid, gpu=0))
            _wait_ended(d, sid)
            assert d.ended.get(sid) == 0
            out = json.loads((tmp_path / f"probe-{sid}.json").read_text())
            assert out["nice"] == min(19, base + 7)
        finally:
            d.shutdown()


def test_warm_ready_counts_processes_whose_imports_are_done(tmp_path):
    assert warm_ready(tmp_path / "missing") == 0
    d = LocalDispatcher("tailspec.scheduler.busy_sessions:env_probe_session", log_dir=str(tmp_path), warm=2)
    try:
        deadline = time.time() + 60
        while warm_ready(tmp_path) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert warm_ready(tmp_path) == 2
    finally:
        d.shutdown()


def test_a_warm_session_past_its_deadline_gets_a_grace_before_sigterm(tmp_path, redis_url):
    """The stop backstop SIGTERMs a cold process at once, but gives a warm one `warm_stop_grace_s` to stop on its
    own lease check: SIGTERM would end the pooled process, and its replacement would import for seconds on the
    lent GPU's compute. Past the grace it is terminated."""
    entry = "tailspec.scheduler.busy_sessions:slow_stop_session"
    d = LocalDispatcher(entry, log_dir=str(tmp_path), warm=1, extra_env={"TAILSPEC_DEMO_STEP_SLEEP_S": "1.0"})
    try:
        deadline = time.time() + 60
        while warm_ready(tmp_path) < 1 and time.time() < deadline:
            time.sleep(0.05)
        pid = d._warm[0][0].pid
        d.start(_ctx(redis_url, "s-slow", gpu=0))
        time.sleep(0.2)
        d.stop("s-slow")  # past the deadline: the session has not looked at its lease yet
        assert d.procs["s-slow"].terminated_at is None
        _wait_ended(d, "s-slow")
        assert d.ended.get("s-slow") == 0 and [p.pid for p, _ in d._warm] == [pid]  # stopped itself, still pooled

        d.warm_stop_grace_s = 0.0
        d.start(_ctx(redis_url, "s-slow2", gpu=0))
        time.sleep(0.2)
        d.stop("s-slow2")  # marks it
        d.poll()  # the grace is over: SIGTERM
        assert d.procs["s-slow2"].terminated_at is not None
        _wait_ended(d, "s-slow2")
        assert d.ended.get("s-slow2") != 0
    finally:
        d.shutdown()
