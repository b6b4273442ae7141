"""Start and stop a private `redis-server` on a free loopback port (tests and the demo).

No persistence (no RDB, no AOF), bound to 127.0.0.1 only, stopped by pid.
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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

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


def start_redis(port: int | None = None, timeout: float = 10.0) -> RedisServer:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisServerError(
            "redis-server not found on PATH; install it (Debian: apt-get install redis-server) "
            "or pass --redis URL of a running server"
        )
    workdir = tempfile.mkdtemp(prefix="tailspec-redis-")
    for attempt in range(5):
        p = port or free_port()
        proc = subprocess.Popen(
            [exe, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break  # port race: another process took it; retry on a new port
            try:
                with socket.create_connection(("127.0.0.1", p), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return RedisServer(proc, p, workdir)
            except OSError:
                time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if port is not None:
            break
    shutil.rmtree(workdir, ignore_errors=True)
    raise RedisServerError(f"redis-server did not start: {err.strip()[:500]}")
