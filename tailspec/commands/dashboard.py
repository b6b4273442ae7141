"""`tailspec dashboard`: serve the web dashboard and the Prometheus exporter over the cluster state."""

from __future__ import annotations

import argparse
import signal
import threading
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError

from tailspec.commands.args import add_config_args, config_from_args
from tailspec.core.config import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="serve the web dashboard (read-only JSON API, /metrics) and a Prometheus exporter",
        description="Serve the web dashboard on --port (page, /api/state, /api/timeline, /api/schema, /metrics) "
                    "and the Prometheus exporter on --metrics-port (/metrics only). Both bind 127.0.0.1 unless "
                    "--host names another address and --allow-remote is given.",
    )
    add_config_args(p)
    p.add_argument("--host", help="bind address (default: dashboards.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="web dashboard port (default: dashboards.port, 8300)")
    p.add_argument("--metrics-port", type=int,
                   help="Prometheus exporter port (default: dashboards.metrics_port, 9300; 0 = no separate "
                        "exporter, /metrics stays on the dashboard port)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow binding a non-loopback address (the dashboard has no authentication)")
    p.add_argument("--redis", metavar="URL", help="Redis URL of the cluster state (default: cluster.redis_url)")
    p.add_argument("--cluster", metavar="NAME", help="cluster name (key namespace; default: cluster.name)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.dashboards.server import check_bind, start_dashboard, start_exporter

    cfg = config_from_args(args)
    d = cfg.dashboards
    host = args.host or d.host
    port = d.port if args.port is None else args.port
    metrics_port = d.metrics_port if args.metrics_port is None else args.metrics_port
    allow_remote = args.allow_remote or d.allow_remote
    for name, value in (("--port", port), ("--metrics-port", metrics_port)):
        if not 0 <= value <= 65535:
            raise ConfigError(f"{name} must be a TCP port in [0, 65535], got {value}")
    try:  # through the config model, so --redis / --cluster get the same validation as the file
        if args.redis:
            cfg.cluster.redis_url = args.redis
        if args.cluster:
            cfg.cluster.name = args.cluster
    except ValidationError as e:
        raise ConfigError(f"--redis/--cluster: {e.errors()[0]['msg']}") from None
    redis_url, cluster = cfg.cluster.redis_url, cfg.cluster.name
    check_bind(host, allow_remote)  # before anything binds

    web = start_dashboard(redis_url, cluster, host, port, allow_remote)
    servers = [web]
    try:
        if metrics_port:
            servers.append(start_exporter(redis_url, cluster, host, metrics_port, allow_remote))
        print(f"tailspec dashboard: {web.url}/  (cluster {cluster!r}, state {_redacted(redis_url)})", flush=True)
        print(f"prometheus metrics: {servers[-1].url}/metrics", flush=True)
        ev = stop or threading.Event()
        if stop is None and threading.current_thread() is threading.main_thread():
            # Ctrl-C and SIGTERM end the server, also where SIGINT came in ignored (a job started in the
            # background of a non-interactive shell: Python then installs no KeyboardInterrupt handler).
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: ev.set())
        # Wait in short slices: a process-directed signal may land on a server thread, and CPython runs the handler
        # only when the main thread executes bytecode.
        while not ev.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        for s in servers:
            s.stop()
    return 0


def _redacted(url: str) -> str:
    """The Redis URL without its password, for printing."""

    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
