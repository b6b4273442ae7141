"""Benchmarks behind `tailspec bench NAME`. Each module exposes `add_arguments(parser)` and
`run(args) -> dict`; the command prints the module's own table/progress to stderr-or-stdout and, as the
very last stdout line with --json, one JSON object. Register a new one in BENCHES."""

import importlib
from types import ModuleType

BENCHES: dict[str, str] = {
    "task": "tailspec.benchmarks.task",
    "adaptive": "tailspec.benchmarks.adaptive",
    "scheduler": "tailspec.benchmarks.scheduler",
    "dashboard": "tailspec.benchmarks.dashboard",
    "vllm": "tailspec.benchmarks.vllm",
    "trainer": "tailspec.benchmarks.trainer",
    "cotrain": "tailspec.benchmarks.cotrain",
    "engine": "tailspec.benchmarks.engine",
    "e2e": "tailspec.benchmarks.e2e",
    "isolation": "tailspec.benchmarks.isolation",
    "simulate": "tailspec.benchmarks.simulate",
    "attach": "tailspec.benchmarks.attach",
    "faults": "tailspec.benchmarks.faults",
}


def load(name: str) -> ModuleType:
    """The module of bench `name` (a key of BENCHES)."""
    return importlib.import_module(BENCHES[name])
