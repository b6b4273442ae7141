"""The import rules of docs/architecture.md ("Import arrows"), checked on every `import` statement in the source,
function-local ones included: the floor (`tailspec.core`) imports nothing above it, components import only the
floor, and the roof's projection and integrations are imported only where the map says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> import name (the four components sit at the repository root; pyproject's package-dir)
FOLDERS = {
    "tailspec": "tailspec",
    "scheduler": "tailspec.scheduler",
    "drafter_trainer": "tailspec.drafter_trainer",
    "rollout": "tailspec.rollout",
    "dashboards": "tailspec.dashboards",
}
COMPONENTS = ("scheduler", "drafter_trainer", "rollout", "dashboards")


def module_name(path: Path) -> str:
    for folder, pkg in FOLDERS.items():
        base = ROOT / folder
        if path.is_relative_to(base):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            return ".".join([pkg, *parts])
    raise AssertionError(path)


def imports_of(path: Path) -> set[str]:
    """Every tailspec module `path` imports (`from a import b` counts as a.b when a.b is a module)."""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tailspec"))
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                target = f"{base}.{target}" if target else base
            if target.startswith("tailspec"):
                out.update(f"{target}.{a.name}" for a in node.names)  # a.b if b is a module, else a.b(name)
                out.add(target)
    return out


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in ("core", *COMPONENTS):
        return parts[1]
    return "roof"


def all_sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


GRAPH = {module_name(p): imports_of(p) for p in all_sources()}


def violations(rule, graph: dict[str, set[str]] | None = None) -> list[str]:
    graph = GRAPH if graph is None else graph
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts if not rule(m, t) and t != "tailspec")


def component_rule(component: str):
    return lambda m, t: layer(m) != component or layer(t) in ("core", component)


def test_the_source_tree_was_found():
    assert "tailspec.core.state" in GRAPH and "tailspec.rollout.engine" in GRAPH and "tailspec.cli" in GRAPH
    assert "tailspec.core.state" in GRAPH["tailspec.scheduler.leases"]


def test_the_floor_imports_nothing_above_it():
    bad = violations(lambda m, t: layer(m) != "core" or layer(t) == "core")
    assert not bad, bad


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_component_imports_only_the_floor_and_itself(component):
    bad = violations(component_rule(component))
    assert not bad, bad


def test_the_projection_imports_only_the_selector_cost_model_and_idle_detector():
    allowed = ("tailspec.core", "tailspec.simulate", "tailspec.rollout.cost_model", "tailspec.rollout.selector",
               "tailspec.scheduler.idle")
    bad = violations(lambda m, t: not m.startswith("tailspec.simulate") or t.startswith(allowed))
    assert not bad, bad


@pytest.mark.parametrize("roof_part, importers", [
    ("tailspec.simulate", ("tailspec.simulate", "tailspec.commands.simulate", "tailspec.bench.simulate")),
    ("tailspec.integrations", ("tailspec.integrations", "tailspec.bench")),
])
def test_roof_parts_are_imported_only_by_their_command_and_bench(roof_part, importers):
    bad = violations(lambda m, t: not t.startswith(roof_part) or m.startswith(importers))
    assert not bad, bad


def test_the_rule_check_itself_catches_a_violation():
    graph = dict(GRAPH)
    graph["tailspec.rollout.engine"] = GRAPH["tailspec.rollout.engine"] | {"tailspec.scheduler.client"}
    assert violations(component_rule("rollout"), graph) == ["tailspec.rollout.engine -> tailspec.scheduler.client"]
