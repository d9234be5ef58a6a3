"""Extra top-level commands (``serve``, ``calibrate``) registered by modules that may not be loaded.

Each entry names a module with ``add_parser(subparsers, add_engine_args)``; it is
imported only when the CLI is built, and only if it exists.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

COMMAND_MODULES: list[str] = ["semkv.server.command", "semkv.calibrate"]


def add_extension_parsers(subparsers, add_engine_args: Callable) -> None:
    for name in COMMAND_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(name).add_parser(subparsers, add_engine_args)
