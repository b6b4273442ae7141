"""The code's shape: a report of the longest modules and functions, and one rule for imports.

Size is a report, not a failure: `test_size_report` prints the 10 longest modules and the 10 longest functions
(`pytest -s` or `-rA` shows them). A long entry is a prompt to look, not a cap: split code where a concept ends,
never at a line count. Measured with ast: a function's lines run from its `def` (decorators excluded) to its
last statement, nested functions counted in their enclosing one too.

The rule: every import inside a function says why it is not at module level: a comment line starting with
`# deferred:` between the function's `def` and the import (one comment may cover a group of imports).
Tests are not checked."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tailspec", "core", "scheduler", "drafter_trainer", "rollout", "dashboards", "benchmarks")
REPORT_TOP = 10

# Still holding a function-local import with no `# deferred:` reason. Each entry must still have one
# (test_deferred_exemptions_are_still_needed), so giving the reasons removes it.
EXEMPT_DEFERRED: set[str] = set()
DEFERRED = "# deferred:"


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def module_lengths() -> dict[str, int]:
    """Lines of every source module, by path from the repository root."""
    return {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in sources()}


def function_lengths() -> dict[str, int]:
    """Lines of every function, as `path:name` (the longest where a module has several of one name)."""
    out: dict[str, int] = {}
    for p in sources():
        rel = p.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{rel}:{node.name}"
                out[key] = max(node.end_lineno - node.lineno + 1, out.get(key, 0))
    return out


def longest(lengths: dict[str, int], n: int = REPORT_TOP) -> list[tuple[str, int]]:
    """The n longest entries, longest first (ties by name)."""
    return sorted(lengths.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def size_report() -> str:
    lines = [f"{REPORT_TOP} longest modules (lines):"]
    lines += [f"  {n:5d}  {name}" for name, n in longest(module_lengths())]
    lines += [f"{REPORT_TOP} longest functions (lines):"]
    lines += [f"  {n:5d}  {name}" for name, n in longest(function_lengths())]
    return "\n".join(lines)


def undeferred_imports(text: str, filename: str = "<text>") -> list[tuple[int, str]]:
    """(line, function) of each import statement nested in a function with no `# deferred:` comment line
    between that function's `def` and the import (the innermost function enclosing it)."""
    lines = text.splitlines()
    out = []

    def visit(node: ast.AST, func: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child)
                continue
            if func is not None and isinstance(child, (ast.Import, ast.ImportFrom)):
                between = lines[func.lineno:child.lineno - 1]
                if not any(line.strip().startswith(DEFERRED) for line in between):
                    out.append((child.lineno, func.name))
            visit(child, func)

    visit(ast.parse(text, filename), None)
    return out


def files_with_undeferred_imports() -> dict[str, list[str]]:
    out = {}
    for p in sources():
        found = undeferred_imports(p.read_text(), str(p))
        if found:
            out[p.relative_to(ROOT).as_posix()] = [f"{f}:{line}" for line, f in found]
    return out


def test_the_sources_were_found():
    names = {p.relative_to(ROOT).as_posix() for p in sources()}
    assert "scheduler/service.py" in names and "drafter_trainer/model.py" in names and "tailspec/cli.py" in names


def test_size_report():
    """Prints the report (shown with `pytest -s`, or `-rA` as this test's captured output); fails only if it
    found no sources, lists them out of order or names a file that is not there."""
    report = size_report()
    print("\n" + report)
    for lengths in (module_lengths(), function_lengths()):
        top = longest(lengths)
        assert len(top) == REPORT_TOP, top
        assert [n for _, n in top] == sorted((n for _, n in top), reverse=True), top
        assert top[-1][1] >= max(n for name, n in lengths.items() if name not in dict(top)), "a longer one left out"
        assert all(f"  {n:5d}  {name}" in report for name, n in top), report
        assert all((ROOT / name.split(":")[0]).is_file() for name, _ in top), top
    assert longest({"a": 1, "b": 3, "c": 2}, 2) == [("b", 3), ("c", 2)]


def test_the_deferred_check_reads_comments_between_def_and_import():
    text = """
import os


def covered():
    x = 1
    # deferred: a reason
    import json
    from pathlib import Path

    return json, Path, x


def bare():
    import json

    return json


# deferred: above the def does not count
def outside():
    import json

    def inner():
        import math

        return math

    return json, inner


class C:
    def method(self):
        if True:
            # deferred: a reason
            import math
        return math
"""
    assert undeferred_imports(text) == [(15, "bare"), (22, "outside"), (25, "inner")]


def test_function_local_imports_say_why_they_are_deferred():
    found = {k: v for k, v in files_with_undeferred_imports().items() if k not in EXEMPT_DEFERRED}
    assert not found, f"function-local imports with no '{DEFERRED}' comment above them: {found}"


def test_deferred_exemptions_are_still_needed():
    stale = EXEMPT_DEFERRED - set(files_with_undeferred_imports())
    assert not stale, f"every local import now says why, drop from EXEMPT_DEFERRED: {stale}"
