"""`tailspec dashboard` as a user runs it: a real process serving both ports, and its refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_dashboards_writer import StateWriter

from tailspec.redis_server import free_port

TAILSPEC = [sys.executable, "-m", "tailspec.cli"]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def test_dashboard_command_serves_page_api_and_exporter(redis_client, redis_url):
    StateWriter(redis_client, cluster="demo").populate()
    port, mport = free_port(), free_port()
    proc = subprocess.Popen(TAILSPEC + ["dashboard", "--redis", redis_url, "--cluster", "demo",
                                        "--port", str(port), "--metrics-port", str(mport)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TAILSPEC_CONFIG": ""})
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert "prometheus metrics" in proc.stdout.readline()
        st = json.loads(_get(f"http://127.0.0.1:{port}/api/state"))
        assert st["cluster"] == "demo" and [g["state"] for g in st["gpus"]] == ["lent", "generating"]
        assert b"<title>tailspec dashboard</title>" in _get(f"http://127.0.0.1:{port}/")
        metrics = _get(f"http://127.0.0.1:{mport}/metrics").decode()
        assert "tailspec_lent_gpu_seconds_total 2.0" in metrics
        assert b"tailspec exporter" in _get(f"http://127.0.0.1:{mport}/")  # exporter port: /metrics only
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(f"http://127.0.0.1:{mport}/api/state")
        assert e.value.code == 404
    finally:
        proc.send_signal(signal.SIGINT)
        # It must exit cleanly; how fast is not this test's business (a clean-clone CI run beside the TRL test
        # took over 10 s to get the signal handled).
        assert proc.wait(timeout=60) == 0


def test_dashboard_command_refuses_remote_bind_without_flag(redis_url):
    out = subprocess.run(TAILSPEC + ["dashboard", "--redis", redis_url, "--host", "0.0.0.0",
                                     "--port", str(free_port())],
                         capture_output=True, text=True, timeout=30, check=False, env={**os.environ, "TAILSPEC_CONFIG": ""})
    assert out.returncode == 2
    assert "refusing to bind" in out.stderr and "--allow-remote" in out.stderr


def test_dashboard_command_reads_its_config_section(redis_url, tmp_path: Path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dashboards:\n  host: 192.168.7.7\n")
    out = subprocess.run(TAILSPEC + ["dashboard", "--config", str(cfg), "--redis", redis_url],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and "'192.168.7.7'" in out.stderr
    out = subprocess.run(TAILSPEC + ["dashboard", "--redis", redis_url, "--cluster", "bad name"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and "--cluster" in out.stderr


def test_redis_password_is_not_printed(redis_url):
    from tailspec.commands.dashboard import _redacted

    assert _redacted("redis://:s3cret@db.internal:6380/0") == "redis://:***@db.internal:6380/0"
    assert _redacted("rediss://user:pw@h/1") == "rediss://user:***@h/1"
    assert _redacted(redis_url) == redis_url
