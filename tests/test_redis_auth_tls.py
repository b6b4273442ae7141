"""Redis URLs with a password and with TLS, end to end on private redis-servers started here: one with
`--requirepass`, one TLS-only (`--port 0 --tls-port`, a throw-away CA and server certificate made with the
openssl command line). Through each URL: the client's writes, the scheduler loop lending a GPU to a real
session process (which renews its lease through the same URL), and a trainer's SampleReader. A wrong or
missing password and a TLS URL without the CA are refused at once with a sentence naming the fix, by the
client's constructor and by `tailspec scheduler run`. Skips (with the reason) where openssl or TLS support
in redis-server is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from tailspec.core import state
from tailspec.core.config import TailspecConfig
from tailspec.core.redis_conn import RedisSetupError
from tailspec.core.state import Sample, SessionInfo
from tailspec.drafter_trainer.samples import SampleBuffer, SampleReader
from tailspec.scheduler.client import TailspecClient

from tailspec.redis_server import free_port

PASSWORD = "s3cr:t@/pw"  # characters that must be URL-encoded
WRONG = "b4dPa55"
ENTRY = "tailspec.scheduler.busy_sessions:busy_session"
REPO = Path(__file__).resolve().parent.parent


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A self-signed CA and a server certificate for 127.0.0.1 / localhost signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line to make a test CA and certificate")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tailspec test CA",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
             "-out", "server.csr", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "ext.cnf", "-out", "server.crt", cwd=d)
    return d


def _start(args: list[str], url: str, workdir: Path) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("needs redis-server")
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir),
                             "--loglevel", "warning", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")
            if "tls" in " ".join(args) and ("Bad directive" in err or "TLS" in err or "tls" in err):
                pytest.skip(f"this redis-server was built without TLS support: {err.strip()[:200]}")
            raise RuntimeError(f"redis-server {args} exited: {err[:500]}")
        try:
            r = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
            r.ping()
            r.close()
            return proc
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server {args} did not answer at {url}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def password_url(tmp_path_factory):
    port = free_port()
    url = f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0"
    proc = _start(["--port", str(port), "--requirepass", PASSWORD], url, tmp_path_factory.mktemp("redis-pw"))
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def tls_url(certs, tmp_path_factory):
    port = free_port()
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={quote(str(certs / 'ca.crt'))}"
    proc = _start(["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs / "server.crt"),
                   "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
                   "--tls-auth-clients", "no"], url, tmp_path_factory.mktemp("redis-tls"))
    yield url
    _stop(proc)


@pytest.fixture(params=["password", "tls"])
def secure_url(request):
    return request.getfixturevalue(f"{request.param}_url")


def _cfg(url: str, cluster: str) -> TailspecConfig:
    # Through validation, as a config file or --set would give it.
    cfg = TailspecConfig.model_validate({"cluster": {"name": cluster, "redis_url": url}})
    cfg.scheduler.telemetry = "simulated"
    cfg.scheduler.simulated_gpus = 2
    cfg.scheduler.session_entry = ENTRY
    cfg.scheduler.lease_ttl_s = 2.0
    cfg.scheduler.session_startup_s = 0.0
    return cfg


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _sessions(r, cluster: str) -> list[SessionInfo]:
    out = []
    for sid in r.smembers(state.key(cluster, "sessions")):
        info = state.get(r, state.key(cluster, "session", session_id=sid.decode()), SessionInfo)
        if info is not None:
            out.append(info)
    return out


def test_config_accepts_password_and_tls_urls(password_url, tls_url):
    for url in (password_url, tls_url, "rediss://:pw@redis.example:6380/2?ssl_cert_reqs=required",
                "redis://tailspec:pw@10.0.0.5:6379/0", "unix:///run/redis.sock?db=0&password=pw"):
        assert TailspecConfig.model_validate({"cluster": {"redis_url": url}}).cluster.redis_url == url


def test_client_scheduler_session_and_sample_reader_work_through_the_url(secure_url, request):
    from tailspec.scheduler.service import run_local

    cluster = "sec-" + request.node.callspec.id
    cfg = _cfg(secure_url, cluster)
    r = redis.Redis.from_url(secure_url, socket_timeout=2.0)  # as a session's context connects
    stop = threading.Event()
    th = threading.Thread(target=run_local, args=(cfg, stop), daemon=True)
    th.start()
    c = TailspecClient(secure_url, cluster=cluster, node=cfg.cluster.node)
    try:
        # GPU 1's worker still generates (the tail), GPU 0 drained: the scheduler lends GPU 0 to a session
        # process, which renews its lease through the same URL at every step.
        c.set_phase("rollout", step=1)
        c.report_progress("w0", [0], active=0, finished=8, step=1)
        c.report_progress("w1", [1], active=3, finished=5, step=1)
        live = _wait(lambda: [s for s in _sessions(r, cluster) if s.status == "running" and s.step >= 2], 60,
                     "a running session")
        assert [s.gpu for s in live] == [0]
        c.set_phase("train", step=1)
        _wait(lambda: all(s.status == "stopped" for s in _sessions(r, cluster)), 15, "the session stopped")
        assert {s.stop_reason for s in _sessions(r, cluster)} == {"revoked"}
        # samples: written by the client, read by a trainer's reader
        sent = [Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5, i % 20], reward=1.0, policy_version=1)
                for i in range(25)]
        assert c.submit_samples(sent) == 25
        assert c.flush(10) and c.errors == 0
        buf = SampleBuffer(capacity=100, holdout_fraction=0.0)
        reader = SampleReader(r, cluster, buf, vocab_size=21, max_seq_len=64)
        assert reader.poll() == 25 and not reader.dropped
    finally:
        c.close()
        stop.set()
        th.join(10)
        r.close()
    assert not th.is_alive()


def _bad_urls(password_url: str, tls_url: str) -> list[tuple[str, str]]:
    no_ca = tls_url.split("?", 1)[0]
    return [
        (password_url.replace(quote(PASSWORD, safe=""), WRONG), "refused the password"),
        (password_url.replace(":" + quote(PASSWORD, safe="") + "@", ""), "requires a password"),
        (no_ca, "ssl_ca_certs"),
    ]


def test_wrong_password_or_tls_setting_is_a_clear_error_at_the_client(password_url, tls_url):
    for url, expect in _bad_urls(password_url, tls_url):
        t = time.monotonic()
        with pytest.raises(RedisSetupError, match=expect) as e:
            TailspecClient(url, cluster="bad", node="n0")
        assert time.monotonic() - t < 5  # refused at once, not retried like an outage
        msg = str(e.value)
        assert msg.startswith("redis_url: ") and WRONG not in msg, msg
        assert ":***@" in msg or "@" not in url, msg  # the password is never printed
        assert isinstance(e.value, ValueError)  # what a bad argument raises everywhere in the client
    assert not [t for t in threading.enumerate() if t.name == "tailspec-client"]  # nothing left running


def test_wrong_password_is_a_clear_error_from_scheduler_run(password_url, tls_url):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for url, expect in _bad_urls(password_url, tls_url)[:2]:
        p = subprocess.run([sys.executable, "-m", "tailspec.cli", "scheduler", "run", "--redis", url,
                            "--set", "scheduler.telemetry=simulated"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        assert expect in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert WRONG not in p.stderr and quote(PASSWORD, safe="") not in p.stderr, p.stderr
