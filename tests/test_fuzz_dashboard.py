"""Bad input, fuzzed: the dashboard's HTTP API (dashboards/server.py) over raw sockets.

Every case is one request written byte by byte: path traversal (../, %2e%2e, double-encoded, absolute paths,
backslashes, NUL bytes, very long paths), oversized requests (request line, one header, many headers, headers
in all, declared bodies), every method but GET (the usual ones, CONNECT, lower case, garbage tokens), bodies on
GET, malformed Content-Length / Transfer-Encoding, and malformed query parameters on the API endpoints (NaN,
inf, negative, huge, non-numeric windows; unknown and repeated parameters). The status each case must get is
decided here from what the case is, not by the server. After each case:
- no 500, and a 200 only where the case asks for a served resource, whose body is exactly that resource;
- a connection the server keeps open answers a normal GET next, exactly (so nothing of the case was left
  unread to be parsed as a request), and one it closes is closed;
- a new connection's normal GET works.

Case counts: printed, and written to test-output/fuzz-cases.json.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from urllib.parse import quote

import pytest
from fuzz_helpers import FUZZ, Tally
from hypothesis import given, settings
from hypothesis import strategies as st
from tailspec.dashboards.server import (
    MAX_GET_BODY,
    MAX_HEADER_BYTES,
    STATIC_FILES,
    start_dashboard,
    static_file,
)
from tailspec.dashboards.snapshot import MAX_WINDOW_S
from test_dashboards_writer import StateWriter

CASES = 120  # per test below; four tests
HOST = b"Host: localhost\r\n"
NORMAL = b"GET /api/schema HTTP/1.1\r\n" + HOST + b"\r\n"
ANY = None  # expected status: any refusal (4xx) is right


@dataclass
class Case:
    raw: bytes
    expect: int | tuple[int, ...] | None  # a status, several allowed, or ANY 4xx
    kind: str
    head: bool = False  # a HEAD request: the answer has no body
    serves: bytes | None = None  # for an expected 200: the exact body (None: JSON checked by the caller)


def request(method: bytes, target: bytes, headers: list[bytes] = (), body: bytes = b"",
            version: bytes = b"HTTP/1.1") -> bytes:
    return method + b" " + target + b" " + version + b"\r\n" + HOST + b"".join(headers) + b"\r\n" + body


# -- reading answers off the socket --------------------------------------------------------------------------
def read_response(f, head: bool = False) -> tuple[int, dict[str, str], bytes] | None:
    """One response from the buffered socket file; None when the server closed the connection."""
    try:
        line = f.readline(70_000)
    except ConnectionResetError:
        return None
    if not line:
        return None
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", line)
    assert m, f"not a status line: {line[:120]!r}"
    headers: dict[str, str] = {}
    while True:
        h = f.readline(70_000)
        if h in (b"\r\n", b"\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    n = 0 if head else int(headers.get("content-length", "0"))
    body = f.read(n)
    assert len(body) == n, f"short body: {len(body)} of {n} bytes"
    return int(m.group(1)), headers, body


def closed(sock: socket.socket, f) -> bool:
    """True when the server has closed (EOF or reset) within the timeout."""
    sock.settimeout(5)
    try:
        return f.read(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


class Judge:
    def __init__(self, port: int, tally: Tally, schema_body: bytes):
        self.port, self.tally, self.schema_body = port, tally, schema_body

    def normal_get(self, f) -> None:
        got = read_response(f)
        assert got is not None, "connection closed before the normal GET after the case was answered"
        status, _, body = got
        assert (status, body) == (200, self.schema_body), (
            f"the next request on the connection got {status} {body[:160]!r}: part of the case was parsed as a "
            f"request")

    def __call__(self, case: Case) -> int:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            f = s.makefile("rb")
            s.sendall(case.raw)
            got = read_response(f, case.head)
            assert got is not None, f"{case.kind}: connection closed with no answer"
            status, headers, body = got
            assert status < 500, (case.kind, status, body[:200])
            if case.expect is ANY:
                assert 400 <= status < 500, (case.kind, status, case.raw[:200])
            else:
                allowed = case.expect if isinstance(case.expect, tuple) else (case.expect,)
                assert status in allowed, (case.kind, status, allowed, case.raw[:300], body[:200])
            if status == 200 and case.serves is not None:
                assert body == case.serves, (case.kind, body[:200])
            if status != 200:
                assert b"root:" not in body and b"import " not in body, body[:200]
            keep = headers.get("connection", "").lower() != "close" and b" HTTP/1.0\r\n" not in case.raw[:70_000]
            if keep:
                s.sendall(NORMAL)
                self.normal_get(f)
            else:
                assert closed(s, f), f"{case.kind}: answered 'Connection: close' but left the connection open"
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:  # still serving
            f = s.makefile("rb")
            s.sendall(NORMAL)
            self.normal_get(f)
        self.tally.add(f"{case.kind}:{status}")
        return status


@pytest.fixture
def dash(redis_client, redis_url):
    StateWriter(redis_client).populate()
    srv = start_dashboard(redis_url, "t")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        f = s.makefile("rb")
        s.sendall(NORMAL)
        status, _, body = read_response(f)
    assert status == 200 and json.loads(body)["api_version"] == 1
    yield srv, body
    srv.stop()


def run(dash, name: str, strategy: st.SearchStrategy[Case]) -> Tally:
    srv, schema_body = dash
    tally = Tally(f"dashboard_{name}")
    judge = Judge(srv.port, tally, schema_body)

    @settings(FUZZ, max_examples=CASES)
    @given(strategy)
    def one(case: Case) -> None:
        judge(case)
        tally.add("cases")

    one()
    tally.report("cases")
    assert tally.counts["cases"] >= CASES * 0.9, tally.counts
    return tally


# -- path traversal ------------------------------------------------------------------------------------------
TRAVERSAL = ["..", "%2e%2e", "%2E%2E", ".%2e", "%252e%252e", "%25252e%25252e", "..%2f", "..%252f", "..%5c",
             "..\\", "%c0%ae%c0%ae", "....", ".", "%2e", "~", "%00", "\x00", "\\..\\..", "..;", "%u002e%u002e"]
TARGETS = ["etc/passwd", "server.py", "__init__.py", "../core/config.py", "C:\\Windows\\win.ini",
           "proc/self/environ", "index.html", "dashboard.js", "static", "api/state", ""]
PREFIXES = ["/static/", "/", "//", "/api/", "/api/state/", "/metrics/", "\\", "/static\\", "/static/%2f",
            "http://localhost/static/", "/static//", "file:///", "C:\\", "/static/index.html/"]
path_chars = st.characters(min_codepoint=0, max_codepoint=255, blacklist_characters="\r\n #?\t\x0b\x0c\x1c\x1d\x1e"
                           "\x1f\x85\xa0")


@st.composite
def traversal_cases(draw) -> Case:
    parts = draw(st.lists(st.one_of(st.sampled_from(TRAVERSAL), st.sampled_from(TARGETS),
                                    st.text(path_chars, max_size=8)), min_size=1, max_size=8))
    sep = draw(st.sampled_from(["/", "\\", "%2f", "%5c", "%252f", "/./", "//"]))
    path = draw(st.sampled_from(PREFIXES)) + sep.join([draw(st.sampled_from(TRAVERSAL[:12]))] + parts)
    if draw(st.booleans()):
        path = path + "/" + "a" * draw(st.integers(1000, 60_000))  # very long, under the request-line limit
    target = path.encode("latin-1")
    method = b"GET"
    if draw(st.integers(0, 9)) == 0:  # a whitelisted file with a traversal in the query: the fixed file
        name = draw(st.sampled_from(STATIC_FILES))
        return Case(request(method, f"/static/{name}?{quote(path)}".encode()), 200, "static_query",
                    serves=static_file(name)[0])
    return Case(request(method, target), 404, "traversal")


def test_path_traversal_is_404_and_serves_no_file(dash):
    tally = run(dash, "traversal", traversal_cases())
    assert tally.counts.get("traversal:404", 0) > CASES // 2, tally.counts


# -- oversized requests, bodies on GET, framing --------------------------------------------------------------
@st.composite
def oversized_cases(draw) -> Case:
    kind = draw(st.sampled_from(["long_url", "long_line", "many_headers", "header_bytes", "get_body",
                                 "big_get_body", "bad_length", "chunked", "big_post", "long_url_ok"]))
    if kind == "long_url":  # over the 64 KiB request line
        return Case(request(b"GET", b"/static/" + b"a" * draw(st.integers(65_537, 90_000))), 414, kind)
    if kind == "long_url_ok":
        return Case(request(b"GET", b"/api/state?" + b"x" * draw(st.integers(1_000, 60_000))), 400, kind)
    if kind == "long_line":  # one header line over 64 KiB
        return Case(request(b"GET", b"/api/state", [b"X-Big: " + b"b" * draw(st.integers(65_537, 80_000))
                                                      + b"\r\n"]), 431, kind)
    if kind == "many_headers":
        n = draw(st.integers(101, 400))
        return Case(request(b"GET", b"/api/state", [b"X-H%d: v\r\n" % i for i in range(n)]), 431, kind)
    if kind == "header_bytes":  # each line fine, all together over MAX_HEADER_BYTES
        size = draw(st.integers(4_000, 60_000))
        n = MAX_HEADER_BYTES // size + draw(st.integers(1, 5))
        return Case(request(b"GET", b"/api/state", [b"X-H%d: %s\r\n" % (i, b"v" * size) for i in range(n)]),
                    431, kind)
    if kind == "get_body":  # read and discarded; a request inside it must not be served
        inner = request(b"GET", draw(st.sampled_from([b"/static/../server.py", b"/etc/passwd", b"/nope"])))
        body = (inner * draw(st.integers(1, 50)))[: MAX_GET_BODY]
        body += draw(st.binary(max_size=max(0, MAX_GET_BODY - len(body))))
        path = draw(st.sampled_from([b"/api/state", b"/api/schema", b"/metrics", b"/"]))
        return Case(request(b"GET", path, [b"Content-Length: %d\r\n" % len(body)], body), 200, kind)
    if kind == "big_get_body":  # declared over the limit: refused before a byte of it is read
        n = draw(st.integers(MAX_GET_BODY + 1, 10**18 - 1))
        return Case(request(b"GET", b"/api/state", [b"Content-Length: %d\r\n" % n]), 413, kind)
    if kind == "bad_length":
        values = draw(st.one_of(
            st.sampled_from([[b"-1"], [b"nope"], [b"1e3"], [b"0x10"], [b"+5"], [b"5, 5"], [b"5", b"6"],
                             [b"9" * 19], [b""], [b"\xd9\xa1"], [b"4 4"]]),
            st.lists(st.binary(min_size=1, max_size=6).filter(
                lambda b: b"\n" not in b and b"\r" not in b and not re.fullmatch(rb"[ \t]*[0-9]+[ \t]*", b)),
                min_size=1, max_size=2)))
        return Case(request(b"GET", b"/api/state", [b"Content-Length: " + v + b"\r\n" for v in values]), 400, kind)
    if kind == "chunked":  # a GET body framed by Transfer-Encoding is refused; the chunk is never a request
        inner = request(b"GET", b"/etc/passwd")
        te = draw(st.sampled_from([b"chunked", b"gzip, chunked", b"identity", b"Chunked", b"x"]))
        cl = draw(st.sampled_from([b"", b"Content-Length: 3\r\n"]))
        return Case(request(b"GET", b"/api/state", [b"Transfer-Encoding: " + te + b"\r\n", cl],
                            b"%x\r\n" % len(inner) + inner + b"\r\n0\r\n\r\n"), 400, kind)
    # big_post: a huge declared body on a method that is refused anyway
    method = draw(st.sampled_from([b"POST", b"PUT", b"PATCH"]))
    n = draw(st.integers((1 << 20) + 1, 10**18 - 1))
    return Case(request(method, b"/api/state", [b"Content-Length: %d\r\n" % n]), 405, kind)


def test_oversized_and_malformed_framing_are_refused(dash):
    tally = run(dash, "oversized", oversized_cases())
    assert sum(1 for k in tally.counts if k.split(":")[0] != "cases") >= 8, tally.counts  # most kinds drawn


# -- methods other than GET ----------------------------------------------------------------------------------
token = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
METHODS = ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "HEAD", "get", "Get", "PROPFIND",
           "MKCOL", "BREW", "PRI", "GET\x00", "G\x7fET", "M-SEARCH", "do_GET", "__init__", "_send", "GETS"]


@st.composite
def method_cases(draw) -> Case:
    method = draw(st.one_of(st.sampled_from(METHODS), token.filter(lambda m: m != "GET"),
                            st.text(st.characters(min_codepoint=128, max_codepoint=255,
                                                  blacklist_characters="\x85\xa0"), min_size=1, max_size=6)))
    target = draw(st.sampled_from([b"/api/state", b"/api/timeline?window=60", b"/metrics", b"/", b"/static/index.html",
                                   b"/nope", b"localhost:80", b"*", b"/static/../server.py"]))
    headers, body = [], b""
    if draw(st.booleans()):
        body = draw(st.one_of(st.binary(max_size=2000), st.just(request(b"GET", b"/etc/passwd"))))
        headers.append(b"Content-Length: %d\r\n" % len(body))
    m = method.encode("latin-1")
    return Case(request(m, target, headers, body), 405, "method", head=m == b"HEAD")


def test_methods_other_than_get_are_405(dash, redis_client):
    before = {k: redis_client.dump(k) for k in redis_client.keys()}
    tally = run(dash, "methods", method_cases())
    assert tally.counts.get("method:405", 0) == tally.counts["cases"], tally.counts
    after = {k: redis_client.dump(k) for k in redis_client.keys()}
    assert all(before.get(k) == v for k, v in after.items())  # nothing written (keys with a TTL may expire)


# -- query parameters ----------------------------------------------------------------------------------------
good_windows = st.one_of(st.integers(1, int(MAX_WINDOW_S)).map(str),
                         st.floats(1.0, MAX_WINDOW_S).map(repr), st.sampled_from(["1", "86400", "60.0", "1e2", " 30"]))
bad_windows = st.one_of(
    st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e400", "-1e400", "0", "-0", "0.999",
                     "86400.001", "1e12", "-60", "", " ", "abc", "60s", "1,5", "0x10", "\x00", "60\x00", "None",
                     "[60]", "%", "1e-400", "9" * 400]),
    st.floats(max_value=0.999).map(repr),
    st.floats(min_value=MAX_WINDOW_S + 0.01).map(repr),
    st.integers(min_value=int(MAX_WINDOW_S) + 1).map(str),
    st.integers(max_value=0).map(str),
    st.text(st.characters(categories=["L", "P", "S"]), min_size=1, max_size=10),
)
unknown_keys = st.sampled_from(["limit", "limits", "path", "file", "Window", "window ", "w", "window[]", "\x00",
                                "", "../window", "limit=1&x"])


def qs(pairs: list[tuple[str, str]]) -> str:
    return "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)


@st.composite
def query_cases(draw) -> Case:
    kind = draw(st.sampled_from(["window_good", "window_bad", "unknown", "state", "repeated"]))
    if kind == "window_good":
        return Case(request(b"GET", b"/api/timeline?" + qs([("window", draw(good_windows))]).encode()), 200, kind)
    if kind == "window_bad":
        return Case(request(b"GET", b"/api/timeline?" + qs([("window", draw(bad_windows))]).encode()), 400, kind)
    if kind == "unknown":
        pairs = [(draw(unknown_keys), draw(st.one_of(good_windows, bad_windows)))]
        if draw(st.booleans()):
            pairs.insert(draw(st.integers(0, 1)), ("window", draw(good_windows)))
        return Case(request(b"GET", b"/api/timeline?" + qs(pairs).encode()), 400, kind)
    if kind == "state":  # /api/state takes no parameters at all
        pairs = draw(st.lists(st.tuples(st.one_of(unknown_keys, st.just("window")), st.one_of(good_windows, bad_windows)),
                              min_size=1, max_size=4))
        return Case(request(b"GET", b"/api/state?" + qs(pairs).encode()), 400, kind)
    # repeated window: the last one counts; a bad last one is refused
    first = draw(st.one_of(good_windows, bad_windows))
    ok = draw(st.booleans())
    last = draw(good_windows if ok else bad_windows)
    return Case(request(b"GET", b"/api/timeline?" + qs([("window", first), ("window", last)]).encode()),
                200 if ok else 400, kind)


def test_malformed_query_parameters_are_400(dash):
    tally = run(dash, "query", query_cases())
    assert tally.counts.get("window_bad:400", 0) >= 5 and tally.counts.get("window_good:200", 0) >= 5, tally.counts
