"""`tailspec top` against a live local scheduler (the scheduler benchmark's contract: tests/test_scheduler_bench.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from tailspec.core.config import TailspecConfig
from tailspec.scheduler.client import TailspecClient

from tailspec.top import gather, render_rich, render_text


def test_top_shows_states_leases_and_sessions_labelled_simulated(redis_url, redis_client):
    from tailspec.scheduler.service import run_local

    cfg = TailspecConfig()
    cfg.cluster.name = "t-top"
    cfg.scheduler.telemetry = "simulated"
    cfg.scheduler.simulated_gpus = 2
    cfg.scheduler.session_entry = "tailspec.scheduler.busy_sessions:busy_session"
    cfg.scheduler.session_startup_s = 0.0
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), kwargs={"redis_url": redis_url}, daemon=True)
    th.start()
    c = TailspecClient(redis_url, cluster="t-top")
    try:
        c.set_phase("rollout", step=2, policy_version=2)
        c.report_progress("w0", [0], active=0, finished=4, step=2)
        c.report_progress("w1", [1], active=3, finished=1, step=2)
        deadline = time.time() + 30
        snap = None
        while time.time() < deadline:
            snap = gather(redis_client, "t-top")
            rows = {r.gpu: r for r in snap.rows}
            if len(rows) == 2 and rows[0].state == "lent" and (rows[0].session_step or 0) > 0:
                break
            time.sleep(0.05)
        rows = {r.gpu: r for r in snap.rows}
        assert rows[0].state == "lent" and rows[0].lease_token is not None and rows[0].session_step > 0
        assert rows[1].state == "generating" and rows[1].worker == "w1" and rows[1].util > 50
        text = render_text(snap, "t-top")
        assert "SIMULATED telemetry" in text and " sim" in text
        assert "phase rollout step 2 policy v2" in text
        assert f"t{rows[0].lease_token}" in text and rows[0].session_id in text
        render_rich(snap, "t-top")  # builds without error
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tailspec.cli",
                "top",
                "--once",
                "--redis",
                redis_url,
                "--set",
                "cluster.name=t-top",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "SIMULATED telemetry" in out.stdout and "lent" in out.stdout and "generating" in out.stdout
    finally:
        c.close()
        stop.set()
        th.join(10)


def test_top_without_redis_says_so():
    out = subprocess.run(
        [sys.executable, "-m", "tailspec.cli", "top", "--once", "--redis", "redis://127.0.0.1:1/0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "cannot reach Redis" in out.stderr
