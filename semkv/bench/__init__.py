"""Evaluation suites. Each suite module has ``add_arguments(parser)`` and ``run(args) -> int``.

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import importlib
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# One benchmark at a time per machine: timings of two suites running at once mean nothing. Other CPU-heavy
# work (test runs) may hold the lock shared; a benchmark waiting for it holds the turnstile, which shared
# holders pass through first (`flock TURNSTILE true; flock -s LOCK cmd`), so a benchmark is not starved.
LOCK_PATH = Path(os.environ.get("SEMKV_BENCH_LOCK", Path(tempfile.gettempdir()) / "semkv-bench.lock"))
TURNSTILE_PATH = LOCK_PATH.with_suffix(".turnstile")

SUITES: dict[str, str] = {
    "runtime": "semkv.bench.runtime",
    "prefix": "semkv.bench.prefix",
    "blend": "semkv.bench.blend",
    "share": "semkv.bench.share",
    "sparse": "semkv.bench.sparse",
    "serve": "semkv.bench.serve",
    "redis-writes": "semkv.bench.redis_writes",
    "batching": "semkv.bench.batching",
    "summary-plot": "semkv.bench.summary_plot",
    "gpu": "semkv.bench.gpu",
}


def add_bench_parsers(parser, add_engine_args: Callable) -> None:
    sub = parser.add_subparsers(dest="suite", required=True)
    for name, module_name in SUITES.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a package the suite needs (the server's) is not installed
            if exc.name is None or exc.name.startswith("semkv"):
                raise
            # takes any arguments (prefix_chars matches no option) and says what is missing
            p = sub.add_parser(name, help=f"unavailable: {exc.name} is not installed", prefix_chars="\x01")
            p.add_argument("ignored", nargs=argparse.REMAINDER)
            p.set_defaults(bench_run=functools.partial(_unavailable, name, exc.name))
            continue
        p = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        add_engine_args(p)
        p.add_argument("--out", default="results", help="folder for JSON, Markdown and PNG results")
        module.add_arguments(p)
        p.add_argument(
            "--lock",
            choices=("exclusive", "shared"),
            default="exclusive",
            help="exclusive (default): run alone, timings valid; shared: a quality-only run beside other "
            "non-timing work (tests), its timings are not valid and not to be reported",
        )
        p.add_argument(
            "--no-lock", action="store_true", help="don't wait for other benchmarks on this machine"
        )
        p.set_defaults(bench_run=exclusive(module.run))


def _unavailable(suite: str, package: str, args) -> int:
    print(f"semkv: error: bench {suite} needs {package}, which is not installed", file=sys.stderr)
    return 2


def exclusive(run: Callable) -> Callable:
    """Wrap a suite's ``run`` so it holds the machine-wide benchmark lock while it runs: exclusively (the
    default: timings are valid), or shared with ``--lock shared`` (a quality-only run)."""

    @functools.wraps(run)
    def locked(args) -> int:
        if getattr(args, "no_lock", False) or getattr(args, "merge", None):
            return run(args)  # --merge only summarises earlier runs: no model, no timing
        if getattr(args, "lock", "exclusive") == "shared":
            print(
                "--lock shared: this run's timings are not valid (other work may run beside it)",
                file=sys.stderr,
            )
            with open(TURNSTILE_PATH, "a") as turnstile:
                fcntl.flock(turnstile, fcntl.LOCK_EX)  # let a waiting benchmark go first
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            with open(LOCK_PATH, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)
                try:
                    return run(args)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        with open(LOCK_PATH, "a") as lock, open(TURNSTILE_PATH, "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # new shared holders wait from now on
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(
                    f"waiting for other semkv work on this machine to finish (lock {LOCK_PATH})",
                    file=sys.stderr,
                    flush=True,
                )
                start = time.monotonic()
                fcntl.flock(lock, fcntl.LOCK_EX)
                print(f"lock acquired after {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            try:
                return run(args)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    return locked
