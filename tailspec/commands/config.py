"""`tailspec config show | schema`."""

from __future__ import annotations

import argparse

from tailspec.commands.args import add_config_args, config_from_args
from tailspec.core.config import dump_config
from tailspec.core.state import schema_table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the effective configuration or the cluster-state schema")
    csub = p.add_subparsers(dest="config_cmd", metavar="ACTION")
    csub.required = True
    show = csub.add_parser("show", help="print the effective config (defaults < file < env < --set)")
    add_config_args(show)
    show.set_defaults(func=_show)
    schema = csub.add_parser("schema", help="print every Redis key of the cluster state as a table")
    schema.set_defaults(func=_schema)


def _show(args: argparse.Namespace) -> int:
    print(dump_config(config_from_args(args)), end="")
    return 0


def _schema(args: argparse.Namespace) -> int:
    print(schema_table())
    return 0
