"""The web dashboard's server: read-only JSON API with a documented schema, and its security rules."""

from __future__ import annotations

import http.client
import json
import re
import socket
import urllib.error
import urllib.request

import jsonschema
import pytest
from tailspec.core.config import ConfigError
from tailspec.dashboards.server import MAX_GET_BODY, BindRefused, check_bind, is_loopback, start_dashboard
from test_dashboards_writer import StateWriter


@pytest.fixture
def dash(redis_url):
    srv = start_dashboard(redis_url, "t")
    yield srv
    srv.stop()


def request(srv, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def get_json(srv, path: str):
    status, headers, body = request(srv, "GET", path)
    assert headers["Content-Type"] == "application/json", (status, body[:200])
    return status, json.loads(body)


def test_state_and_timeline_match_their_documented_schema(redis_client, dash):
    StateWriter(redis_client).populate()
    status, schema = get_json(dash, "/api/schema")
    assert status == 200 and set(schema["endpoints"]) == {"/api/state", "/api/timeline", "/metrics"}
    status, st = get_json(dash, "/api/state")
    assert status == 200
    jsonschema.validate(st, schema["endpoints"]["/api/state"]["response"])
    assert [(g["id"], g["state"]) for g in st["gpus"]] == [("node0:0", "lent"), ("node0:1", "generating")]
    assert st["simulated"] is True and st["counters"]["reclaimed_share"] == 0.5
    status, tl = get_json(dash, "/api/timeline?window=120")
    assert status == 200 and tl["window_s"] == 120
    jsonschema.validate(tl, schema["endpoints"]["/api/timeline"]["response"])
    assert [lane["segments"][-1]["state"] for lane in tl["gpus"]] == ["lent", "generating"]
    # a response that breaks the schema is caught by it (the check can fail)
    st["gpus"][0]["state"] = "sleeping"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(st, schema["endpoints"]["/api/state"]["response"])


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "BREW"])
def test_api_rejects_every_method_but_get(redis_client, dash, method):
    w = StateWriter(redis_client)
    w.cycle(0, "generating")
    before = redis_client.dbsize()
    for path in ("/api/state", "/api/timeline", "/metrics", "/"):
        status, headers, body = request(dash, method, path, body=b'{"state": "lent"}',
                                        headers={"Content-Type": "application/json"})
        assert status == 405, (method, path, status)
        assert headers["Allow"] == "GET"
        if method != "HEAD":
            assert b"read-only" in body
    assert redis_client.dbsize() == before
    status, _ = get_json(dash, "/api/state")
    assert status == 200  # the server still answers after refusing


@pytest.mark.parametrize("path", [
    "/static/../server.py", "/static/..%2fserver.py", "/static/%2e%2e/%2e%2e/etc/passwd", "/static//etc/passwd",
    "/static/server.py", "/static/", "/etc/passwd", "/api/state/../../x", "/../../etc/passwd",
    "/static/index.html?file=/etc/passwd",
])
def test_no_endpoint_serves_a_path(dash, path):
    status, _, body = request(dash, "GET", path)
    if path.startswith("/static/index.html"):
        assert status == 200 and b"tailspec dashboard" in body  # query ignored, fixed file
    else:
        assert status == 404, path
        assert b"root:" not in body and b"import" not in body


def test_static_files_are_the_shipped_ones(dash):
    status, headers, body = request(dash, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'src="/static/uPlot.iife.min.js"' in body and b"http" not in body.split(b"<body>")[1].split(b"/metrics")[0]
    status, headers, body = request(dash, "GET", "/static/uPlot.iife.min.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript") and b"uPlot" in body[:200]
    status, _, body = request(dash, "GET", "/static/uPlot.LICENSE")
    assert status == 200 and b"MIT" in body
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "default-src 'self'" in headers["Content-Security-Policy"]


def test_query_parameters_are_validated(dash):
    for q, msg in [("window=abc", "window must be"), ("window=0", "window must be"),
                   ("window=1e12", "window must be"), ("path=/etc/passwd", "unknown query parameter"),
                   ("window=60&file=x", "unknown query parameter")]:
        status, body = get_json(dash, "/api/timeline?" + q)
        assert status == 400 and msg in body["error"], (q, body)
    status, body = get_json(dash, "/api/state?file=x")
    assert status == 400


def test_host_header_must_be_loopback_on_a_loopback_bind(dash):
    # a DNS-rebinding page would reach 127.0.0.1 with its own host name
    status, _, _ = request(dash, "GET", "/api/state", headers={"Host": "attacker.example:8300"})
    assert status == 403
    for host in (f"localhost:{dash.port}", f"127.0.0.1:{dash.port}", "localhost"):
        status, _, _ = request(dash, "GET", "/api/state", headers={"Host": host})
        assert status == 200, host


def test_non_loopback_bind_is_refused_unless_asked(redis_url):
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.10"):
        with pytest.raises(BindRefused, match="--allow-remote"):
            start_dashboard(redis_url, "t", host=host)
        with pytest.raises(ConfigError):  # the CLI prints ConfigError cleanly (exit 2)
            check_bind(host, allow_remote=False)
    check_bind("10.1.2.3", allow_remote=True)
    srv = start_dashboard(redis_url, "t", host="0.0.0.0", allow_remote=True)
    try:
        status, _, _ = request(srv, "GET", "/api/state", headers={"Host": "dashboard.lan"})
        assert status == 200  # explicit remote mode: any Host
    finally:
        srv.stop()


def test_is_loopback():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.10", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "8.8.8.8", "no-such-host.invalid"))


def test_redis_down_gives_503_with_a_reason_and_the_page_still_loads():
    from tailspec.redis_server import free_port

    srv = start_dashboard(f"redis://127.0.0.1:{free_port()}/0", "t")
    try:
        status, body = get_json(srv, "/api/state")
        assert status == 503 and "unreadable" in body["error"]
        status, _, _ = request(srv, "GET", "/")
        assert status == 200
    finally:
        srv.stop()


def test_port_in_use_is_a_clear_error(redis_url, dash):
    with pytest.raises(ConfigError, match=f"cannot bind 127.0.0.1:{dash.port}"):
        start_dashboard(redis_url, "t", port=dash.port)


def test_keep_alive_connection_serves_several_requests(dash):
    with socket.create_connection(("127.0.0.1", dash.port), timeout=10):
        pass
    conn = http.client.HTTPConnection("127.0.0.1", dash.port, timeout=10)
    for _ in range(3):
        conn.request("GET", "/api/schema")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["api_version"] == 1
    conn.close()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{dash.url}/nope", timeout=10)
    assert e.value.code == 404


def test_malformed_requests_do_not_hurt_the_server(dash):
    for raw in (b"POST /api/state HTTP/1.1\r\nHost: localhost\r\nContent-Length: nope\r\n\r\n",
                b"PUT /api/state HTTP/1.1\r\nHost: localhost\r\nContent-Length: -4\r\n\r\n",
                b"GARBAGE\r\n\r\n", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", dash.port), timeout=10) as s:
            s.sendall(raw)
            reply = s.recv(400)
        # an error status (a request line without a version gets the stdlib's HTTP/0.9-style error page)
        assert reply.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")) or b"Error code: 400" in reply, reply[:80]
    status, _ = get_json(dash, "/api/schema")
    assert status == 200


def _responses(s: socket.socket) -> list[bytes]:
    """Status lines of everything the server sends until it closes or goes quiet for 0.5 s."""
    s.settimeout(0.5)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return re.findall(rb"HTTP/1\.1 \d{3}", data)


def test_a_get_body_is_never_parsed_as_the_next_request(dash):
    # A GET with a body on a kept-alive connection: the body is read and dropped, so the request inside it is
    # not served; the request after it is. Before the fix the server answered 200 then 404 for the body.
    inner = b"GET /static/../server.py HTTP/1.1\r\nHost: localhost\r\n\r\n"
    nxt = b"GET /static/uPlot.LICENSE HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", dash.port), timeout=10) as s:
        s.sendall(b"GET /api/schema HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(inner)
                  + inner + nxt)
        assert _responses(s) == [b"HTTP/1.1 200", b"HTTP/1.1 200"]
    # a body framed otherwise (chunked) or too large to skip is refused and the connection closed
    for head, body, status in [
        (b"Transfer-Encoding: chunked\r\n", b"%x\r\n" % len(inner) + inner + b"\r\n0\r\n\r\n", b"400"),
        (b"Content-Length: 5\r\nContent-Length: 6\r\n", b"hello", b"400"),
        (b"Content-Length: %d\r\n" % (MAX_GET_BODY + 1), inner, b"413"),
    ]:
        with socket.create_connection(("127.0.0.1", dash.port), timeout=10) as s:
            s.sendall(b"GET /api/state HTTP/1.1\r\nHost: localhost\r\n" + head + b"\r\n" + body + nxt)
            assert _responses(s) == [b"HTTP/1.1 " + status], head
    status, _ = get_json(dash, "/api/schema")
    assert status == 200
