"""Static checks of the device boundary (issue 47): the model's tensors are made on the runtime's device,
host copies are explicit, and the per-layer loops never wait for the device.

* :func:`test_tensor_constructors_name_a_device`: in ``semkv/models/``, ``semkv/reuse/``, ``semkv/sparse/``,
  ``engine.py``, ``scheduler.py`` and ``sequence.py``, every ``torch.tensor / zeros / ones / empty / full /
  arange / rand* / linspace / logspace / eye / as_tensor / randperm / Generator`` call passes ``device=`` (a tensor
  made without one lands on the CPU whatever the model's device: the crashes the issue measured on a GPU).
  ``*_like`` and ``x.new_*`` inherit their device and are fine.
* :func:`test_numpy_only_of_host_copies`: ``.numpy()`` only on a ``.cpu()`` copy (``.numpy()`` of a cuda
  tensor raises).
* :func:`test_no_host_sync_in_per_layer_loops`: in the functions of :data:`PER_LAYER` (the layer loops, and
  what they call at every layer) no ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, and no
  ``int(...)`` / ``bool(...)`` / ``float(...)`` of a tensor expression, nor an ``if`` on ``.any()`` /
  ``.all()``: each one waits for the device to finish the queued kernels, once per layer.

What is injected: nothing; the package's source is parsed (``ast``). What must happen: no finding outside
the allow-lists, and no allow-list entry that matches nothing (a fixed site leaves a stale entry: drop it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import semkv

ROOT = Path(semkv.__file__).parent
SCANNED = ("models", "reuse", "sparse", "engine.py", "scheduler.py", "sequence.py")

CONSTRUCTORS = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "randn",
        "rand",
        "randint",
        "randperm",
        "linspace",
        "logspace",
        "eye",
        "Generator",
    }
)

# The per-layer code: qualified name -> "loop" (only the body of its ``for`` loops runs per layer) or
# "body" (the whole function runs once per layer). Update it when the layer loop moves.
PER_LAYER: dict[str, str] = {
    "semkv.models.runtime.Runtime.run_layers": "loop",
    "semkv.models.runtime.RowsPass.step": "body",
    "semkv.models.runtime.RowsPass._select": "body",
    "semkv.models.runtime.RowsPass._narrow": "body",
    "semkv.models.runtime.DecodePass.step": "body",
    "semkv.models.runtime.DecodePass._own_attention": "body",
    "semkv.models.runtime.DecodePass._masked_attention": "body",
    "semkv.models.runtime.DecodePass._gathered_attention": "body",
    "semkv.models.runtime.DecodePass._shared_attention": "body",
    "semkv.reuse.selective.SelectiveRecompute.select": "body",
    "semkv.reuse.selective.SelectiveRecompute._keep": "body",
    "semkv.reuse.selective.QueryProbe.select": "body",
    "semkv.reuse.selective.QueryProbe.observe": "body",
    "semkv.reuse.selective.QueryProbe.attention": "body",
    "semkv.reuse.selective.QueryProbe._record": "body",
    "semkv.reuse.selective.QueryProbe._add": "body",
    "semkv.reuse.selection.base.ContextScaling.__call__": "body",
    "semkv.reuse.selection.chunk_start.ChunkStartSelector.score": "body",
    "semkv.reuse.selection.deviation.DeviationSelector.score": "body",
    "semkv.reuse.selection.query.QuerySelector.score": "body",
    "semkv.reuse.selection.query.QueryDeviationSelector.score": "body",
    "semkv.reuse.selection.random_rows.RandomSelector.score": "body",
    "semkv.sparse.index.capture_prefill_queries.record": "body",
}

# (file relative to semkv/, qualified function name or a piece of the flagged line) -> why it may stay.
# Kept short: every entry needs a reason.
ALLOWED_CONSTRUCTORS: dict[tuple[str, str], str] = {}
ALLOWED_NUMPY: dict[tuple[str, str], str] = {}
ALLOWED_SYNCS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Finding:
    """One flagged call: its file (relative to ``semkv/``), enclosing function, line and source."""

    file: str
    function: str
    line: int
    source: str

    def __str__(self) -> str:
        return f"semkv/{self.file}:{self.line} in {self.function}: {self.source}"


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)


class Scope(ast.NodeVisitor):
    """Walks a module keeping the qualified name of the enclosing class / function of every node."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.calls: list[tuple[str, ast.Call]] = []
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}

    def _enter(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        if not isinstance(node, ast.ClassDef):
            self.functions[".".join(self.stack)] = node
        self.generic_visit(node)
        self.stack.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        self.calls.append((".".join(self.stack) or "<module>", node))
        self.generic_visit(node)


def parse(path: Path) -> tuple[Scope, list[str]]:
    text = path.read_text(encoding="utf-8")
    scope = Scope()
    scope.visit(ast.parse(text))
    return scope, text.splitlines()


def finding(path: Path, function: str, node: ast.AST, lines: list[str]) -> Finding:
    return Finding(str(path.relative_to(ROOT)), function, node.lineno, lines[node.lineno - 1].strip())


def is_constructor_without_device(call: ast.Call) -> bool:
    func = call.func
    if not (
        isinstance(func, ast.Attribute)
        and func.attr in CONSTRUCTORS
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
    ):
        return False
    # ``**options`` may carry the device: not decidable here, so not flagged
    return not any(keyword.arg in ("device", None) for keyword in call.keywords)


def receiver_chain(node: ast.expr) -> list[ast.expr]:
    """The receivers of a chained expression, outermost first: ``a.b().c()`` -> [a.b().c, a.b(), a.b, a]."""
    chain = []
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        chain.append(node)
        node = node.func if isinstance(node, ast.Call) else node.value
    return [*chain, node]


def is_host_copy(node: ast.expr) -> bool:
    """The expression goes through ``.cpu()`` or ``.to("cpu")`` before the call on it."""
    for link in receiver_chain(node):
        if isinstance(link, ast.Call) and isinstance(link.func, ast.Attribute):
            if link.func.attr == "cpu":
                return True
            if link.func.attr == "to" and any(
                isinstance(arg, ast.Constant) and arg.value == "cpu"
                for arg in [*link.args, *(k.value for k in link.keywords)]
            ):
                return True
    return False


def is_numpy_of_device_tensor(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr == "numpy" and not is_host_copy(func.value)


def allowed(found: Finding, allow: dict[tuple[str, str], str], used: set[tuple[str, str]]) -> bool:
    for key in allow:
        file, where = key
        if file == found.file and (where == found.function or where in found.source):
            used.add(key)
            return True
    return False


def check(findings: list[Finding], allow: dict[tuple[str, str], str], what: str) -> None:
    used: set[tuple[str, str]] = set()
    bad = [f for f in findings if not allowed(f, allow, used)]
    stale = [key for key in allow if key not in used]
    message = []
    if bad:
        message.append(f"{len(bad)} {what}:\n" + "\n".join(f"  {f}" for f in bad))
    if stale:
        message.append(
            "allow-list entries that match nothing (drop them):\n" + "\n".join(f"  {k}" for k in stale)
        )
    assert not message, "\n".join(message)


def constructor_findings() -> list[Finding]:
    out = []
    for path in scanned_files():
        scope, lines = parse(path)
        out += [
            finding(path, fn, call, lines) for fn, call in scope.calls if is_constructor_without_device(call)
        ]
    return out


def numpy_findings() -> list[Finding]:
    out = []
    for path in scanned_files():
        scope, lines = parse(path)
        out += [finding(path, fn, call, lines) for fn, call in scope.calls if is_numpy_of_device_tensor(call)]
    return out


# -- host syncs -------------------------------------------------------------------------------------------
SYNC_METHODS = frozenset({"item", "tolist", "cpu", "numpy"})
TRUTH_METHODS = frozenset({"any", "all"})
HOST_CASTS = frozenset({"int", "bool", "float"})
HOST_FUNCTIONS = frozenset({"len", "min", "max", "round", "abs", "sum", "getattr", "math"})


def is_tensor_expression(node: ast.expr) -> bool:
    """A guess, on the side of flagging: an expression that indexes, calls a method or compares, other
    than ``len(...)``-like host functions and constants."""
    if isinstance(node, ast.Constant):
        return False
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in HOST_FUNCTIONS:
            return any(is_tensor_expression(arg) for arg in node.args)
        if isinstance(func, ast.Attribute) and func.attr in ("numel", "dim", "size", "stride"):
            return False  # shape metadata is on the host
        return True
    if isinstance(node, (ast.Subscript, ast.Compare)):
        return True
    return any(
        is_tensor_expression(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr)
    )


def sync_nodes(root: ast.AST) -> list[ast.AST]:
    """The host syncs under ``root``: sync methods, host casts of tensor expressions, ``if`` on
    ``.any()`` / ``.all()``."""
    out: list[ast.AST] = []
    for node in ast.walk(root):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in SYNC_METHODS:
                out.append(node)
            elif (
                isinstance(func, ast.Name)
                and func.id in HOST_CASTS
                and node.args
                and is_tensor_expression(node.args[0])
            ):
                out.append(node)
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            test = node.test
            tests = test.values if isinstance(test, ast.BoolOp) else [test]
            for t in tests:
                t = t.operand if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) else t
                if (
                    isinstance(t, ast.Call)
                    and isinstance(t.func, ast.Attribute)
                    and t.func.attr in TRUTH_METHODS
                ):
                    out.append(t)
    return out


def per_layer_roots(function: ast.FunctionDef | ast.AsyncFunctionDef, scope: str) -> list[ast.AST]:
    if scope == "body":
        return list(function.body)
    return [node for node in ast.walk(function) if isinstance(node, (ast.For, ast.AsyncFor))]


def sync_findings() -> tuple[list[Finding], list[str]]:
    """Host syncs in :data:`PER_LAYER`'s functions, and the names there that no longer exist."""
    found: list[Finding] = []
    modules: dict[str, tuple[Path, Scope, list[str]]] = {}
    missing = []
    for qualified, scope_kind in PER_LAYER.items():
        module, name = find_module(qualified)
        if module is None:
            missing.append(qualified)
            continue
        if module not in modules:
            path = ROOT.parent / (module.replace(".", "/") + ".py")
            modules[module] = (path, *parse(path))
        path, scope, lines = modules[module]
        function = scope.functions.get(name)
        if function is None:
            missing.append(qualified)
            continue
        seen: set[int] = set()
        for root in per_layer_roots(function, scope_kind):
            for node in sync_nodes(root):
                if id(node) not in seen:
                    seen.add(id(node))
                    found.append(finding(path, name, node, lines))
    return found, missing


def find_module(qualified: str) -> tuple[str | None, str]:
    """Split ``semkv.pkg.module.Class.method`` into the module's dotted name and the rest."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if (ROOT.parent / (module.replace(".", "/") + ".py")).is_file():
            return module, ".".join(parts[cut:])
    return None, qualified


# -- the tests --------------------------------------------------------------------------------------------
def test_tensor_constructors_name_a_device() -> None:
    check(constructor_findings(), ALLOWED_CONSTRUCTORS, "tensor constructors without device=")


def test_numpy_only_of_host_copies() -> None:
    check(numpy_findings(), ALLOWED_NUMPY, ".numpy() calls not on a .cpu() copy")


def test_no_host_sync_in_per_layer_loops() -> None:
    found, missing = sync_findings()
    assert not missing, f"PER_LAYER names functions that do not exist (update the list): {missing}"
    check(found, ALLOWED_SYNCS, "host syncs in per-layer code")


def test_the_scanners_flag_what_they_guard_against(tmp_path) -> None:
    """The scanners themselves: each flags its pattern and passes its fixed form."""
    source = (
        "import torch\n"
        "def f(x, n):\n"
        "    a = torch.zeros(3)\n"  # flagged
        "    b = torch.zeros(3, device=x.device)\n"
        "    c = torch.zeros_like(x)\n"
        "    g = torch.Generator()\n"  # flagged
        "    h = x.numpy()\n"  # flagged
        "    i = x.detach().cpu().numpy()\n"
        "    for layer in range(n):\n"
        "        if bool(x.any()):\n"  # flagged
        "            pass\n"
        "        if x.all():\n"  # flagged
        "            pass\n"
        "        k = int(x[0])\n"  # flagged
        "        m = x.tolist()\n"  # flagged
        "        j = int(len(x))\n"
        "        s = x.numel()\n"
        "    return a, b, c, g, h, i, k, j, m, s\n"
    )
    tree = ast.parse(source)
    scope = Scope()
    scope.visit(tree)
    made = [call.lineno for _, call in scope.calls if is_constructor_without_device(call)]
    assert made == [3, 6]
    assert [call.lineno for _, call in scope.calls if is_numpy_of_device_tensor(call)] == [7]
    assert not [c.lineno for _, c in scope.calls if is_numpy_of_device_tensor(c) and c.lineno == 8]
    syncs = sorted(
        {node.lineno for root in per_layer_roots(scope.functions["f"], "loop") for node in sync_nodes(root)}
    )
    assert syncs == [10, 12, 14, 15]
