"""Benchmarks behind `tailspec bench NAME`. Each module exposes `add_arguments(parser)` and
`run(args) -> dict`; the command prints the module's own table/progress to stderr-or-stdout and, as the
very last stdout line with --json, one JSON object. Register a new one in BENCHES."""

BENCHES: dict[str, str] = {
    "task": "tailspec.bench.task",
    "adaptive": "tailspec.bench.adaptive",
    "scheduler": "tailspec.bench.scheduler",
    "dashboard": "tailspec.bench.dashboard",
    "vllm": "tailspec.bench.vllm",
    "trainer": "tailspec.bench.trainer",
    "cotrain": "tailspec.bench.cotrain",
    "engine": "tailspec.bench.engine",
    "e2e": "tailspec.bench.e2e",
    "isolation": "tailspec.bench.isolation",
    "simulate": "tailspec.bench.simulate",
    "attach": "tailspec.bench.attach",
    "faults": "tailspec.bench.faults",
}
