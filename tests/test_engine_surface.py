"""The engine's public surface is what the rest of the package uses: no module but ``semkv/engine.py``
reads an engine's ``ctx``, ``runtime``, ``store`` or ``config`` (its internals: the server, calibration,
demos and benchmarks use the engine's public properties and methods instead).

Static (the package's source, parsed): an expression is an engine when its name says so (``engine``,
``self.engine``, ``state.engine``, ``twin_engine``), when it was assigned from ``Engine(...)`` or an
``Engine`` class method, or when it is annotated ``Engine``. Tests are not checked: they test internals.
"""

from __future__ import annotations

import ast
from pathlib import Path

import semkv

ROOT = Path(semkv.__file__).parent
INTERNALS = frozenset({"ctx", "runtime", "store", "config"})
OWNER = ROOT / "engine.py"


def _name(node: ast.expr) -> str | None:
    """The last identifier of ``a.b.c`` / ``c`` (None for other expressions)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _makes_engine(value: ast.expr | None) -> bool:
    """``Engine(...)`` or ``Engine.from_pretrained(...)`` / any ``Engine.<method>(...)``."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    return (isinstance(func, ast.Name) and func.id == "Engine") or (
        isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "Engine"
    )


def _is_engine_type(annotation: ast.expr) -> bool:
    return ast.unparse(annotation).strip("'\"") in ("Engine", "Engine | None", "semkv.engine.Engine")


def engine_names(tree: ast.AST) -> set[str]:
    """Names bound to an engine in a module: assigned from an Engine constructor, or annotated Engine."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _makes_engine(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.arg) and node.annotation is not None and _is_engine_type(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _is_engine_type(node.annotation):
                names.add(node.target.id)
    return names


def reaches_in(path: Path) -> list[str]:
    """``file:line expression`` of each read of an engine's internals in ``path``, in source order."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound = engine_names(tree)
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in INTERNALS]
    where = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path.name
    found = []
    for node in sorted(reads, key=lambda n: (n.lineno, n.col_offset)):
        base = _name(node.value)
        if base is not None and ("engine" in base.lower() or base in bound):
            found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_the_engine():
    offenders = [hit for path in sorted(ROOT.rglob("*.py")) if path != OWNER for hit in reaches_in(path)]
    assert not offenders, "use the engine's public surface instead:\n" + "\n".join(offenders)


def test_the_check_sees_each_way_of_naming_an_engine(tmp_path):
    """The check itself finds a read through each kind of name (so it cannot pass by seeing nothing)."""
    source = tmp_path / "sample.py"
    source.write_text(
        "def f(state, e: Engine, other):\n"
        "    a = state.engine.store\n"
        "    b = e.runtime\n"
        "    twin = Engine.from_pretrained('x')\n"
        "    c = twin.config\n"
        "    d = other.config\n"
        "    return engine.ctx\n",
        encoding="utf-8",
    )
    hits = [hit.split(" ", 1)[1] for hit in reaches_in(source)]
    assert hits == ["state.engine.store", "e.runtime", "twin.config", "engine.ctx"]
