"""`tailspec scheduler run | attach | detach | top`: the idle-GPU scheduler from the command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from tailspec.commands.args import add_config_args, config_from_args
from tailspec.core.redis_conn import RedisSetupError, check


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scheduler", help="run the idle-GPU scheduler on this node (single-node mode)")
    ssub = p.add_subparsers(dest="scheduler_cmd", metavar="ACTION")
    ssub.required = True
    run = ssub.add_parser(
        "run",
        help="telemetry monitor + scheduler loop + local session processes, "
        "until SIGTERM / Ctrl-C (then every lease is revoked)",
    )
    add_config_args(run)
    run.add_argument("--redis", metavar="URL", help="Redis URL (default: cluster.redis_url)")
    run.add_argument("--session-logs", metavar="DIR", help="where session processes write their output")
    run.set_defaults(func=_run)

    a = sub.add_parser(
        "attach", help="join a Ray cluster: detached scheduler actor + telemetry actor per node"
    )
    add_config_args(a)
    a.add_argument("--address", default="auto", help="Ray address: auto or HOST:PORT (default auto)")
    a.add_argument(
        "--redis", metavar="URL", help="Redis URL reachable from every node (default: cluster.redis_url)"
    )
    a.set_defaults(func=_attach)

    d = sub.add_parser("detach", help="remove tailspec's actors from the Ray cluster (revokes every lease)")
    add_config_args(d)
    d.add_argument("--address", default="auto", help="Ray address: auto or HOST:PORT (default auto)")
    d.set_defaults(func=_detach)

    t = sub.add_parser("top", help="live table of GPUs: state, utilization, memory, lease, session step")
    add_config_args(t)
    t.add_argument("--redis", metavar="URL", help="Redis URL (default: cluster.redis_url)")
    t.add_argument("--interval", type=float, default=0.5, help="refresh period in seconds (default 0.5)")
    t.add_argument("--once", action="store_true", help="print the table once as plain text and exit")
    t.set_defaults(func=_top)


def _cfg(args: argparse.Namespace):
    cfg = config_from_args(args)
    if getattr(args, "redis", None):
        cfg.cluster.redis_url = args.redis
    return cfg


def _redis_refused(url: str) -> str | None:
    """Why Redis refuses `url` for good (password, permission, TLS), or None (reachable, or only down: the
    scheduler rides out an outage)."""
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    import redis


    r = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        check(r, url)
    except RedisSetupError as e:
        return str(e)
    finally:
        r.close()
    return None


def _run(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.scheduler.service import run_local
    from tailspec.scheduler.telemetry import TelemetryError

    cfg = _cfg(args)
    if cfg.scheduler.mode == "ray":
        print(
            "tailspec: scheduler.mode is 'ray': start it inside the Ray cluster with `tailspec attach`",
            file=sys.stderr,
        )
        return 2
    why = _redis_refused(cfg.cluster.redis_url)
    if why is not None:
        print(f"tailspec: {why}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"tailspec scheduler: cluster {cfg.cluster.name}, node {cfg.cluster.node}, "
        f"telemetry {cfg.scheduler.telemetry}, sessions {cfg.scheduler.session_entry}; leads or stands by "
        f"(leader TTL {cfg.scheduler.leader_ttl_s:g}s): the log says which",
        flush=True,
    )
    try:
        run_local(cfg, stop, log_dir=args.session_logs)
    except TelemetryError as e:
        print(f"tailspec: {e}", file=sys.stderr)
        return 2
    return 0


def _attach(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.scheduler.attach import attach

    cfg = _cfg(args)
    cfg.scheduler.mode = "ray"
    info = attach(cfg, cfg.cluster.redis_url, address=args.address)
    for t in info["telemetry"]:
        kind = "SIMULATED telemetry" if t["simulated"] else "NVML telemetry"
        print(
            f"node {t['node']}: {len(t['gpus'])} GPUs, {kind}"
            + (f" ({t['warning']})" if t["warning"] else "")
        )
    role = info["scheduler_state"].get("role", "?")
    print(
        f"scheduler actor {info['scheduler']} (namespace {info['namespace']}) running as {role}; "
        f"`tailspec detach` removes it"
    )
    print(json.dumps({"scheduler": info["scheduler"], "nodes": [t["node"] for t in info["telemetry"]]}))
    return 0


def _detach(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    from tailspec.scheduler.attach import detach

    removed = detach(_cfg(args), address=args.address)
    print(f"removed {len(removed)} actors: {', '.join(removed) or '(none found)'}")
    return 0


def _top(args: argparse.Namespace) -> int:
    # deferred: the CLI imports every command module to build its parser; this loads when the command runs
    import redis

    from tailspec.top import run_top

    cfg = _cfg(args)
    r = redis.Redis.from_url(cfg.cluster.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        run_top(r, cfg.cluster.name, interval_s=args.interval, once=args.once)
    except redis.exceptions.ConnectionError as e:
        # deferred: the CLI imports every command module to build its parser; this loads when the command runs
        from tailspec.core.redis_conn import explain, redact

        url = cfg.cluster.redis_url
        print(f"tailspec top: {explain(e, url) or f'cannot reach Redis at {redact(url)}: {e}'}", file=sys.stderr)
        return 1
    return 0
