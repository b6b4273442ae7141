"""The import rules of docs/architecture.md ("Import arrows"), checked on every `import` statement in the source,
function-local ones included: the floor (`tailspec.core`) imports nothing above it, components import only the
floor, and the roof's projection and integrations are imported only where the map says."""

from __future__ import annotations

import pytest

from tests.import_graph import COMPONENTS, GRAPH, layer


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
    ("tailspec.simulate", ("tailspec.simulate", "tailspec.commands.simulate", "tailspec.benchmarks.simulate")),
    ("tailspec.integrations", ("tailspec.integrations", "tailspec.benchmarks")),
])
def test_roof_parts_are_imported_only_by_their_command_and_bench(roof_part, importers):
    bad = violations(lambda m, t: not t.startswith(roof_part) or m.startswith(importers))
    assert not bad, bad


def test_the_rule_check_itself_catches_a_violation():
    graph = dict(GRAPH)
    graph["tailspec.rollout.engine"] = GRAPH["tailspec.rollout.engine"] | {"tailspec.scheduler.client"}
    assert violations(component_rule("rollout"), graph) == ["tailspec.rollout.engine -> tailspec.scheduler.client"]
