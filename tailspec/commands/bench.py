"""`tailspec bench NAME [--json]`: run one benchmark; with --json the last stdout line is one JSON object."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform

from tailspec.benchmarks import BENCHES
from tailspec.commands.args import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints figures; --json: last line is one JSON object)")
    bsub = p.add_subparsers(dest="bench_name", metavar="NAME")
    bsub.required = True
    for name, module in BENCHES.items():
        mod = importlib.import_module(module)
        bp = bsub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--json", action="store_true", help="print one JSON object as the last line")
        add_config_args(bp)
        mod.add_arguments(bp)
        bp.set_defaults(func=_run, bench_module=module)


def machine() -> str:
    try:
        # deferred: the CLI imports every command module to build its parser; this loads when the command runs
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _run(args: argparse.Namespace) -> int:
    mod = importlib.import_module(args.bench_module)
    result = mod.run(args)
    if args.json:
        print(json.dumps(result, separators=(",", ":"), default=float))
    return 0
