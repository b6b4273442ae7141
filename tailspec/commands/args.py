"""The config flags every command that reads config shares: --config FILE and repeated --set key=value."""

from __future__ import annotations

import argparse

from tailspec.core.config import TailspecConfig, load_config


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--config FILE and repeated --set key.path=value, shared by every command that reads config."""
    p.add_argument("--config", metavar="FILE", help="YAML config file (default: $TAILSPEC_CONFIG)")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one config value, e.g. --set scheduler.lease_ttl_s=3 (repeatable)")


def config_from_args(args: argparse.Namespace) -> TailspecConfig:
    return load_config(getattr(args, "config", None), getattr(args, "overrides", None))
