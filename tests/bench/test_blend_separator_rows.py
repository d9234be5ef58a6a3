"""`semkv bench blend --separators`: which rows the bench runs and how it stores their chunks.

Injected: the three ``--separators`` choices over two selector rows. Must hold: ``stored`` / ``recomputed``
set every blend row's ``separator_in_chunk`` (the full-reuse row's too); ``both`` runs each blend row twice,
the second with the separators recomputed and labelled so; the chunks of a group of rows are precomputed
every way its rows need (once per flag), the default's way when no row names one.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from semkv.bench.blend import RowSpec, _chunk_configs, add_arguments, main_rows
from semkv.reuse.options import BlendConfig


def _rows(*flags: str) -> list[RowSpec]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--row", "query@0.15", "--row", "deviation@0.10", *flags])
    base = BlendConfig()
    if args.separators == "recomputed":
        base = replace(base, separator_in_chunk=False)
    return main_rows(args, base)


@pytest.mark.parametrize(("choice", "flag"), [("stored", True), ("recomputed", False)])
def test_one_way_sets_every_blend_row(choice, flag):
    rows = _rows("--separators", choice)
    assert [r.label for r in rows] == [
        "full prefill",
        "prefix caching only",
        "full reuse (ratio 0)",
        "query 0.15",
        "deviation 0.10",
    ]
    assert all(r.config.separator_in_chunk is flag for r in rows if r.config is not None)
    assert [c.separator_in_chunk for c in _chunk_configs(rows)] == [flag]


def test_both_runs_each_blend_row_twice():
    rows = _rows("--separators", "both", "--no-prefix-row", "--no-zero-row")
    assert [(r.label, r.config.separator_in_chunk if r.config else None) for r in rows] == [
        ("full prefill", None),
        ("query 0.15", True),
        ("query 0.15 separators recomputed", False),
        ("deviation 0.10", True),
        ("deviation 0.10 separators recomputed", False),
    ]
    assert [c.separator_in_chunk for c in _chunk_configs(rows)] == [False, True]


def test_rows_without_a_config_store_chunks_the_default_way():
    rows = [RowSpec("full prefill", "none"), RowSpec("prefix caching only", "prefix")]
    assert [c.separator_in_chunk for c in _chunk_configs(rows)] == [BlendConfig.separator_in_chunk]
