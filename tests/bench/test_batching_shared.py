"""The shared-document burst scenario's input checks (its servers are exercised by the bench itself)."""

from __future__ import annotations

import argparse

import pytest

from semkv.bench import batching
from semkv.bench.batching_shared import MODES, QUESTIONS, run_shared_burst


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    batching.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--shared-burst", "1"], "--shared-burst"),
        (["--shared-burst", "4", "--repeats", "0"], "--repeats"),
        (["--shared-burst", "4", "--shared-doc-tokens", "100"], "--shared-doc-tokens"),
    ],
)
def test_bad_settings_are_refused_before_any_server_starts(argv: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        run_shared_burst(parsed(*argv))


def test_the_questions_differ_and_batching_runs_first() -> None:
    assert MODES == ("batching", "no batching")
    assert len(set(QUESTIONS)) == len(QUESTIONS) >= 16
