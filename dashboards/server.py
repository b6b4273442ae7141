"""The web dashboard and the `/metrics` endpoint, served by the standard library's HTTP server.

Read-only by construction: only GET is routed (any other method gets 405), the routes are a fixed
table, and static files come from an in-memory table of the package's own files, so no request
names a path on disk. Binds loopback unless remote access is asked for explicitly; on loopback the
Host header must be a loopback name too (a DNS-rebinding page cannot read the API).

Request framing on a kept-alive connection: a GET's body (Content-Length up to MAX_GET_BODY) is read and
discarded before the answer, so it is never parsed as the next request; a larger one gets 413, a malformed
or repeated Content-Length or any Transfer-Encoding 400, and those connections are closed. Other limits:
a request line over 64 KiB gets 414 (the standard library's), more than 100 header lines or one over
64 KiB 431 (the standard library's), headers over MAX_HEADER_BYTES in all 431.

Endpoints: `/` (the page), `/static/<name>`, `/api/state`, `/api/timeline?window=S`, `/api/schema`,
`/metrics`. Response schemas: dashboards/api.py, served at /api/schema.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tailspec.core.config import ConfigError

from .api import json_schema
from .exporter import make_registry
from .snapshot import MAX_WINDOW_S, HistoryCache, SessionCache, read_state, read_timeline

log = logging.getLogger(__name__)

STATIC_FILES = ("index.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css",
                "uPlot.LICENSE")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".LICENSE": "text/plain; charset=utf-8"}
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-store",
}
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
MAX_GET_BODY = 64 * 1024  # bytes of a GET body read and discarded; more is refused (413)
MAX_HEADER_BYTES = 64 * 1024  # all header lines of one request together; more is refused (431)
_CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")


class BindRefused(ConfigError):
    """A non-loopback bind address was given without allow_remote."""


def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(h, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_bind(host: str, allow_remote: bool) -> None:
    if not is_loopback(host) and not allow_remote:
        raise BindRefused(
            f"refusing to bind the dashboard to {host!r}: it is not a loopback address and the dashboard "
            f"has no authentication. Bind 127.0.0.1 (default), or pass --allow-remote "
            f"(config dashboards.allow_remote: true) to serve it on the network."
        )


_static_cache: dict[str, tuple[bytes, str]] = {}


def static_file(name: str) -> tuple[bytes, str] | None:
    """Package file by whitelisted name; anything not in STATIC_FILES is absent (no path lookup)."""
    if name not in STATIC_FILES:
        return None
    if name not in _static_cache:
        body = (resources.files("tailspec.dashboards") / "static" / name).read_bytes()
        suffix = "." + name.rsplit(".", 1)[-1]
        _static_cache[name] = (body, CONTENT_TYPES.get(suffix, "application/octet-stream"))
    return _static_cache[name]


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] | None = None


def _json(status: int, obj: Any) -> Response:
    return Response(status, json.dumps(obj, separators=(",", ":")).encode())


class App:
    """Routes GET requests of the dashboard (`metrics_only=False`) or of the exporter (True)."""

    def __init__(self, redis_client: Any, cluster: str, metrics_only: bool = False):
        self.r = redis_client
        self.cluster = cluster
        self.registry = make_registry(redis_client, cluster)
        self.history = HistoryCache()  # the timeline's incremental copy of the history streams
        self.ended_sessions = SessionCache()  # ended sessions' records, read once
        routes: dict[str, Callable[[dict[str, list[str]]], Response]] = {"/metrics": self.metrics}
        if not metrics_only:
            routes.update({"/": self.index, "/api/state": self.state, "/api/timeline": self.timeline,
                           "/api/schema": self.schema})
        else:
            routes["/"] = lambda q: Response(200, b"tailspec exporter: see /metrics\n", "text/plain; charset=utf-8")
        self.routes = routes
        self.metrics_only = metrics_only
        self._schema: Response | None = None

    def handle(self, target: str) -> Response:
        parts = urlsplit(target)
        path = parts.path
        query = parse_qs(parts.query, keep_blank_values=True)
        if path in self.routes:
            return self.routes[path](query)
        if not self.metrics_only and path.startswith("/static/"):
            found = static_file(path[len("/static/"):])
            if found:
                return Response(200, found[0], found[1])
        return _json(404, {"error": f"no such endpoint: {path[:200]}"})

    def index(self, query) -> Response:
        body, ctype = static_file("index.html")
        return Response(200, body, ctype)

    def metrics(self, query) -> Response:
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    def schema(self, query) -> Response:
        if self._schema is None:  # constant, and slow for pydantic to build
            self._schema = _json(200, json_schema())
        return self._schema

    def state(self, query) -> Response:
        if query:
            return _json(400, {"error": f"/api/state takes no query parameters (got {sorted(query)})"})
        try:
            view, _ = read_state(self.r, self.cluster, cache=self.ended_sessions)
        except Exception as e:  # noqa: BLE001 — Redis down: the page shows the error and keeps polling
            return _json(503, {"error": f"cluster state unreadable: {e}"})
        return Response(200, view.model_dump_json().encode())

    def timeline(self, query) -> Response:
        unknown = sorted(set(query) - {"window"})
        if unknown:
            return _json(400, {"error": f"unknown query parameter(s) {unknown}; allowed: window"})
        window = 300.0
        if "window" in query:
            raw = query["window"][-1]
            try:
                window = float(raw)
            except ValueError:
                window = float("nan")
            if not (1.0 <= window <= MAX_WINDOW_S):
                return _json(400, {"error": f"window must be a number of seconds in [1, {MAX_WINDOW_S:.0f}], "
                                            f"got {raw[:50]!r}"})
        try:
            view = read_timeline(self.r, self.cluster, window_s=window, cache=self.history)
        except Exception as e:  # noqa: BLE001 — as in state()
            return _json(503, {"error": f"cluster state unreadable: {e}"})
        return Response(200, view.model_dump_json().encode())


class _Handler(BaseHTTPRequestHandler):
    server_version = "tailspec-dashboard"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds a client may idle on a connection (a stalled client frees its thread)

    def setup(self) -> None:
        super().setup()
        # Headers and body go out as two writes: without this, Nagle's algorithm holds the body until the
        # client's delayed ACK of the headers (about 40 ms on every response).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, resp: Response, head_only: bool = False) -> None:
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(resp.body)))
        for k, v in {**SECURITY_HEADERS, **(resp.headers or {})}.items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if not head_only:
            self.wfile.write(resp.body)

    def _host_ok(self) -> bool:
        if not self.server.loopback_only:  # type: ignore[attr-defined]
            return True
        host = (self.headers.get("Host") or "").strip().lower()
        if host.startswith("["):
            name = host[: host.find("]") + 1] if "]" in host else host
        else:
            name = host.rsplit(":", 1)[0] if ":" in host else host
        return name in LOOPBACK_NAMES

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        size = sum(len(k) + len(v) + 4 for k, v in self.headers.items())
        if size > MAX_HEADER_BYTES:
            self.close_connection = True
            self.send_error(431, "Request Header Fields Too Large",
                            f"{size} bytes of headers; at most {MAX_HEADER_BYTES}")
            return False
        return True

    def _body_length(self) -> int | None:
        """The declared body length: 0 without one, None when the framing is not one valid Content-Length
        (Transfer-Encoding, a malformed value, or several that differ)."""
        if self.headers.get("Transfer-Encoding") is not None:
            return None
        values = {v.strip(" \t") for v in self.headers.get_all("Content-Length") or []}
        if not values:
            return 0
        if len(values) > 1 or not _CONTENT_LENGTH.fullmatch(next(iter(values))):
            return None
        return int(next(iter(values)))

    def _discard_body(self, length: int) -> bool:
        """Read and drop `length` body bytes; False (connection closed) when the client sent fewer."""
        while length > 0:
            chunk = self.rfile.read(min(length, 16384))
            if not chunk:
                self.close_connection = True
                return False
            length -= len(chunk)
        return True

    def do_GET(self) -> None:
        # The body first: left unread, it would be parsed as the next request on this connection.
        length = self._body_length()
        if length is None:
            self.close_connection = True
            self._send(_json(400, {"error": "a GET body must be framed by one Content-Length "
                                            "(no Transfer-Encoding)"}))
            return
        if length > MAX_GET_BODY:
            self.close_connection = True
            self._send(_json(413, {"error": f"GET body of {length} bytes; the API reads none "
                                            f"(at most {MAX_GET_BODY} are skipped)"}))
            return
        if length and not self._discard_body(length):
            return
        if not self._host_ok():
            self._send(_json(403, {"error": "Host header is not a loopback name; the dashboard serves "
                                            "loopback clients only (see --allow-remote)"}))
            return
        try:
            resp = self.server.app.handle(self.path)  # type: ignore[attr-defined]
        except Exception:  # a bug in one view must not take the server down
            log.exception("error serving %s", self.path[:200])
            resp = _json(500, {"error": "internal error; see the dashboard's log"})
        self._send(resp)

    def _method_not_allowed(self) -> None:
        # Drain a request body so the connection stays usable, then refuse; a body that is not framed by
        # one Content-Length (chunked, malformed) or is over 1 MiB is left unread and the connection closed.
        length = self._body_length()
        if length is None or length > 1 << 20:
            self.close_connection = True
        elif length and not self._discard_body(length):
            return
        self._send(Response(405, json.dumps({"error": f"method {self.command} not allowed; the API is "
                                                      f"read-only (GET)"}).encode(), headers={"Allow": "GET"}),
                   head_only=self.command == "HEAD")

    def __getattr__(self, name: str) -> Any:
        # Every do_<METHOD> but do_GET → 405 (the stdlib would answer 501 for unknown methods).
        if name.startswith("do_"):
            return self._method_not_allowed
        raise AttributeError(name)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets or times out its connection is not the server's error: no traceback on stderr.
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            log.debug("connection from %s dropped: %s", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)


@dataclass
class RunningServer:
    httpd: _Server
    thread: threading.Thread
    host: str

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve(app: App, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False,
          name: str = "tailspec-dashboard") -> RunningServer:
    """Bind (after the loopback check) and serve `app` on a daemon thread; port 0 picks a free port."""
    check_bind(host, allow_remote)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    server_cls = type("_BoundServer", (_Server,), {"address_family": family})
    try:
        httpd = server_cls((host.strip("[]"), port), _Handler)
    except OSError as e:
        raise ConfigError(f"cannot bind {host}:{port}: {e.strerror or e}") from None
    httpd.app = app  # type: ignore[attr-defined]
    httpd.loopback_only = is_loopback(host)  # type: ignore[attr-defined]
    # A short poll interval makes stop() quick (shutdown waits for the loop to look).
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True)
    t.start()
    return RunningServer(httpd, t, host.strip("[]"))


def redis_client(url: str) -> Any:
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def start_dashboard(redis_url: str, cluster: str, host: str = "127.0.0.1", port: int = 0,
                    allow_remote: bool = False) -> RunningServer:
    """The web dashboard (page, JSON API and /metrics) on one port. The demo calls this and links `.url`."""
    return serve(App(redis_client(redis_url), cluster), host, port, allow_remote)


def start_exporter(redis_url: str, cluster: str, host: str = "127.0.0.1", port: int = 0,
                   allow_remote: bool = False) -> RunningServer:
    """Only /metrics, for Prometheus to scrape (the DCGM-exporter-style port)."""
    return serve(App(redis_client(redis_url), cluster, metrics_only=True), host, port, allow_remote,
                 name="tailspec-exporter")
