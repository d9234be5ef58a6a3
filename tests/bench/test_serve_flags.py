"""The engine flags a serving bench hands to the ``semkv serve`` it starts (``serve_flags``).

Injected: ``semkv bench batching`` command lines with and without ``--no-pack-weights`` /
``--no-keep-freed-memory``. Must happen: each switch given to the bench reaches the server's command
line, and neither appears when not given (the server then keeps its defaults).
"""

from __future__ import annotations

import pytest

from semkv.bench.serve import serve_flags
from semkv.cli import build_parser


def flags_for(*extra: str) -> list[str]:
    return serve_flags(build_parser().parse_args(["bench", "batching", *extra]))


@pytest.mark.parametrize("switch", ["--no-pack-weights", "--no-keep-freed-memory"])
def test_a_bench_switch_reaches_the_server(switch):
    assert switch in flags_for(switch)


def test_no_switch_no_flag():
    flags = flags_for("--threads", "2")
    assert "--no-pack-weights" not in flags and "--no-keep-freed-memory" not in flags
    assert flags[flags.index("--threads") + 1] == "2"
