"""The package's import graph: no circle, benchmarks are leaves, no module imports another's privates.

Every ``import`` / ``from ... import`` anywhere in a module counts (module level, inside functions,
under ``TYPE_CHECKING``): a lazy import that closes a circle is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import semkv

ROOT = Path(semkv.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    base = ROOT.parent / relative
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """(imported semkv module, names taken from it) for every import statement in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names if alias.name.startswith("semkv")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("semkv"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                out.append((child, []) if is_module(child) else (node.module, [alias.name]))
    return out


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        name = module_name(path)
        edges.setdefault(name, set())
        for target, _ in imports_of(path):
            if target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    assert cycles(graph()) == []


def test_cycle_finder_finds_a_planted_circle():
    """The check itself: a planted two-module circle and a three-module one are reported."""
    edges = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(edges)) == [["a", "b"], ["c", "d", "e"]]


def test_library_code_never_imports_the_benchmarks():
    """semkv.bench is a leaf: only the CLI and the bench suites themselves import it."""
    offenders = [
        (name, target)
        for name, targets in graph().items()
        if not name.startswith("semkv.bench") and name != "semkv.cli"
        for target in targets
        if target.startswith("semkv.bench")
    ]
    assert offenders == []


def test_no_module_imports_another_modules_private_names():
    offenders = [
        (module_name(path), target, taken)
        for path in ROOT.rglob("*.py")
        for target, names in imports_of(path)
        for taken in names
        if taken.startswith("_") and not taken.endswith("__") and target != module_name(path)
    ]
    assert offenders == []
