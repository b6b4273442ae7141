"""The layout docs/architecture.md describes: one folder per layer and one rule from import name to path
(`tailspec.X.Y` lives at `X/Y.py` for the floor, the components and the benchmarks, `tailspec.Y` at
`tailspec/Y.py` for the roof), no arrow from below into the roof, no product module importing a bench but the
`tailspec bench` entry, no import circle, and a map whose paths exist."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from tests.import_graph import COMPONENTS, FOLDERS, GRAPH, MODULES, ROOT, cycles, layer

# The one product module that reaches into the benchmarks: `tailspec bench NAME` dispatches to them.
BENCH_ENTRY = "tailspec.commands.bench"


def test_pyproject_installs_every_folder_by_the_one_rule():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = tool["package-dir"]
    assert package_dir == {pkg: folder for folder, pkg in FOLDERS.items()}
    for folder, pkg in FOLDERS.items():
        assert folder == pkg.removeprefix("tailspec.") or (folder, pkg) == ("tailspec", "tailspec")
    packages = {MODULES_NAME for MODULES_NAME, p in MODULES.items() if p.name == "__init__.py"}
    assert set(tool["packages"]) == packages, "pyproject's packages must list every package folder, and only those"


def test_no_package_folder_is_left_out_of_the_rule():
    roots = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"tests"}
    assert roots == set(FOLDERS), f"top-level package folders outside the rule: {roots ^ set(FOLDERS)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_installed_module_is_the_file_the_rule_names(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None and Path(spec.origin).resolve() == MODULES[name].resolve()


def test_nothing_below_the_roof_imports_the_roof_or_a_bench():
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if layer(m) in ("core", *COMPONENTS)
                 for t in ts if layer(t) in ("roof", "benchmarks") and t != "tailspec")
    assert not bad, bad


def test_no_product_module_imports_a_bench():
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if layer(m) != "benchmarks" and m != BENCH_ENTRY
                 for t in ts if layer(t) == "benchmarks")
    assert not bad, bad
    assert any(layer(t) == "benchmarks" for t in GRAPH[BENCH_ENTRY]), "the bench entry is found and checked"


def test_no_import_circle():
    assert cycles(GRAPH) == []


def test_the_circle_check_catches_a_planted_circle():
    graph = {m: set(ts) for m, ts in GRAPH.items()}
    assert "tailspec.core.state" in graph["tailspec.scheduler.leases"]
    graph["tailspec.core.state"] = graph["tailspec.core.state"] | {"tailspec.scheduler.leases"}
    found = cycles(graph)
    assert any({"tailspec.core.state", "tailspec.scheduler.leases"} <= set(c) for c in found), found


def test_the_graph_counts_deferred_and_by_name_imports():
    # the CLI imports its commands by name and `tailspec bench` its benches by name: both count as edges
    assert "tailspec.commands.bench" in GRAPH["tailspec.cli"]
    assert "tailspec.benchmarks.engine" in GRAPH["tailspec.benchmarks"]


def _architecture() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()


def test_the_architecture_page_opens_with_the_glossary():
    headings = re.findall(r"^## (.+)$", _architecture(), re.M)
    assert headings[:2] == ["Glossary", "Layout"], headings[:3]


def _map_entries() -> list[tuple[str, str]]:
    """(folder, name) for every path the layout map names: each entry's folder (the first word of a line of its
    code block), and each `name.py` / `name/` in that entry's description, to be found in that folder or below."""
    block = _architecture().split("## Layout", 1)[1].split("```", 2)[1]
    out: list[tuple[str, str]] = []
    folder = ""
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder = line.split(" ", 1)[0]
            out.append(("", folder))
        if folder.endswith("/"):
            out += [(folder, n) for n in re.findall(r"\b([a-z_-]+(?:\.(?:py|md|sh)|/))", line.split(" ", 1)[-1])]
    return out


def _exists(folder: str, name: str) -> bool:
    base = ROOT / folder
    return (base / name).exists() or any(base.rglob(name.rstrip("/")))


def test_every_path_on_the_map_exists():
    entries = _map_entries()
    assert len(entries) > 60, entries
    missing = [f"{folder}{name}" for folder, name in entries if not _exists(folder, name)]
    assert not missing, f"the map names paths that do not exist: {missing}"
