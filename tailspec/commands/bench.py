"""`tailspec bench NAME [--json]`: run one benchmark; with --json the last stdout line is one JSON object."""

from __future__ import annotations

import argparse
import json

from tailspec import benchmarks
from tailspec.commands.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints figures; --json: last line is one JSON object)")
    bsub = p.add_subparsers(dest="bench_name", metavar="NAME")
    bsub.required = True
    for name in benchmarks.BENCHES:
        mod = benchmarks.load(name)
        bp = bsub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--json", action="store_true", help="print one JSON object as the last line")
        add_config_args(bp)
        mod.add_arguments(bp)
        bp.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    mod = benchmarks.load(args.bench_name)
    result = mod.run(args)
    if args.json:
        print(json.dumps(result, separators=(",", ":"), default=float))
    return 0
