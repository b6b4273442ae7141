"""`tailspec` command line: a thin dispatcher. Each command group lives in its own module exposing
`register(subparsers)`; the module list below is the only shared line to edit when adding one."""

from __future__ import annotations

import argparse
import importlib
import sys

from tailspec import __version__, logs
from tailspec.core.config import ConfigError

# Order = order in `tailspec --help`.
COMMAND_MODULES = [
    "tailspec.commands.demo",
    "tailspec.commands.config",
    "tailspec.commands.task",
    "tailspec.commands.bench",
    "tailspec.commands.dashboard",
    "tailspec.commands.scheduler",
    "tailspec.commands.train",
    "tailspec.commands.export",
    "tailspec.commands.simulate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailspec",
        description="Idle-GPU drafter co-training for RL rollouts.",
    )
    parser.add_argument("--version", action="version", version=f"tailspec {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.configure(verbose=args.verbose)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"tailspec: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tailspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
