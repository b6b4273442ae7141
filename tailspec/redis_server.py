"""Start and stop a private `redis-server` on a free loopback port (tests, the demo, the fault drills).

Bound to 127.0.0.1 only, stopped by pid. No persistence by default (no RDB, no AOF). With `aof=True` it
appends every write to an AOF fsynced once a second (`appendfsync everysec`), so a SIGKILLed server restarted
on the same directory (`restart`) comes back with everything acknowledged more than ~1 s before the kill:
what a user's own Redis must be configured with for the same guarantee (docs/architecture.md, failure model).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass


class RedisServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    proc: subprocess.Popen
    port: int
    workdir: str
    argv: list[str] | None = None  # how it was started: `restart` starts the same server again

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing flushed beyond what the AOF policy already wrote)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5.0)

    def restart(self, timeout: float = 10.0) -> None:
        """Start the same server again (same port, directory and persistence) after a kill or a crash; with
        AOF on, it loads the AOF before it answers."""
        if self.argv is None:
            raise RedisServerError("this server was not started by start_redis: cannot restart it")
        if self.proc.poll() is None:
            raise RedisServerError(f"redis-server on port {self.port} is still running")
        self.proc = _launch(self.argv, self.port, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_redis(port: int | None = None, timeout: float = 10.0, aof: bool = False) -> RedisServer:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisServerError(
            "redis-server not found on PATH; install it (Debian: apt-get install redis-server) "
            "or pass --redis URL of a running server"
        )
    workdir = tempfile.mkdtemp(prefix="tailspec-redis-")
    persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if aof else ["--appendonly", "no"]
    err = ""
    for attempt in range(5):
        p = port or free_port()
        argv = [exe, "--port", str(p), "--bind", "127.0.0.1", "--save", "", *persistence,
                "--dir", workdir, "--protected-mode", "yes", "--loglevel", "warning"]
        try:
            return RedisServer(_launch(argv, p, timeout), p, workdir, argv)
        except RedisServerError as e:  # port race: another process took it; retry on a new port
            err = str(e)
            if port is not None:
                break
    shutil.rmtree(workdir, ignore_errors=True)
    raise RedisServerError(err)


def _launch(argv: list[str], port: int, timeout: float) -> subprocess.Popen:
    """Start redis-server with `argv` and wait until it answers PING on `port`."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    raise RedisServerError(f"redis-server did not start on port {port}: {err.strip()[:500]}")
