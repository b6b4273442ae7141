"""The import graph of the installed package, read from the source with ast (never by importing it): the one
rule from import name to path, and every module's imports of tailspec modules, function-local ones, those under
`TYPE_CHECKING` and `importlib.import_module` on a literal name included. tests/test_imports.py checks the
layers' arrows on it, tests/test_layout.py the layout and the absence of circles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> import name: every top-level package folder X/ installs as tailspec.X (pyproject's
# package-dir), and tailspec/ holds the roof.
FOLDERS = {
    "tailspec": "tailspec",
    "core": "tailspec.core",
    "scheduler": "tailspec.scheduler",
    "drafter_trainer": "tailspec.drafter_trainer",
    "rollout": "tailspec.rollout",
    "dashboards": "tailspec.dashboards",
    "benchmarks": "tailspec.benchmarks",
}
COMPONENTS = ("scheduler", "drafter_trainer", "rollout", "dashboards")


def module_name(path: Path) -> str:
    for folder, pkg in FOLDERS.items():
        base = ROOT / folder
        if path.is_relative_to(base):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            return ".".join([pkg, *parts])
    raise AssertionError(path)


def all_sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


MODULES = {module_name(p): p for p in all_sources()}


def _resolve(target: str, name: str) -> str:
    """`from target import name`: the module target.name if there is one, else target (a name in it)."""
    return f"{target}.{name}" if f"{target}.{name}" in MODULES else target


def imports_of(path: Path) -> set[str]:
    """Every tailspec module `path` imports. `from a import b` counts as a.b when a.b is a module, else as a."""
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
                out.update(_resolve(target, a.name) for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("tailspec")):
            out.add(node.args[0].value)
    return out


def registries_of(path: Path) -> set[str]:
    """Modules named by string in a module that imports by name (`importlib.import_module` on a variable): the
    CLI's command list, the bench registry. Counted as imports so a circle through them is seen."""
    text = path.read_text()
    if "import_module(" not in text:
        return set()
    return {node.value for node in ast.walk(ast.parse(text, str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES}


GRAPH = {m: (imports_of(p) | registries_of(p)) - {m} for m, p in MODULES.items()}


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in ("core", "benchmarks", *COMPONENTS):
        return parts[1]
    return "roof"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)
