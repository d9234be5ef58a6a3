"""The row selectors by name. A new selector is one module plus one line here."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from semkv.reuse.selection.base import RowSelector
from semkv.reuse.selection.chunk_start import ChunkStartSelector
from semkv.reuse.selection.deviation import DeviationSelector
from semkv.reuse.selection.query import QueryDeviationSelector, QuerySelector
from semkv.reuse.selection.random_rows import RandomSelector

SELECTORS: dict[str, type[RowSelector]] = {
    cls.name: cls
    for cls in (DeviationSelector, QuerySelector, QueryDeviationSelector, ChunkStartSelector, RandomSelector)
}


def make_selector(spec: str | dict[str, Any] | RowSelector) -> RowSelector:
    """A selector from a name (its defaults), a dict ``{"name": ..., <its fields>}`` or an instance.

    Unknown names and fields are a ValueError naming them (what an HTTP client sees as a 400).
    """
    if isinstance(spec, RowSelector):
        return spec
    if isinstance(spec, str):
        name, options = spec, {}
    elif isinstance(spec, dict):
        options = dict(spec)
        name = options.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"selector needs a 'name' (one of {', '.join(SELECTORS)}), got {spec!r}")
    else:
        raise ValueError(f"selector must be a name, a dict or a RowSelector, got {type(spec).__name__}")
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}")
    cls = SELECTORS[name]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"selector {name!r} has no option {', '.join(unknown)}; its options: {sorted(known)}"
        )
    return cls(**options)
