"""Evaluation suites. Each suite module has ``add_arguments(parser)`` and ``run(args) -> int``.

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

SUITES: dict[str, str] = {
    "prefix": "semkv.bench.prefix",
    "blend": "semkv.bench.blend",
    "share": "semkv.bench.share",
    "sparse": "semkv.bench.sparse",
    "serve": "semkv.bench.serve",
}


def add_bench_parsers(parser, add_engine_args: Callable) -> None:
    sub = parser.add_subparsers(dest="suite", required=True)
    for name, module_name in SUITES.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        add_engine_args(p)
        p.add_argument("--out", default="results", help="folder for JSON, Markdown and PNG results")
        module.add_arguments(p)
        p.set_defaults(bench_run=module.run)
