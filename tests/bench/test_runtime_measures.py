"""The measures of ``semkv bench runtime`` that are not timings of the model: greedy agreement and the
two decode speeds computed from per-token timestamps.

Injected: token lists equal, differing at the first / a middle / the last token, of unequal length;
timestamps with an uneven first step. Must happen: agreement counts the tokens before the first
difference; ms/token as the user sees it spans the first token to the last; the steady-state step is
the median gap, not the mean.
"""

from __future__ import annotations

import pytest

from semkv.bench.runtime import agreement, median_step_seconds, per_token_seconds


@pytest.mark.parametrize(
    ("other", "expected"),
    [([1, 2, 3, 4], 4), ([9, 2, 3, 4], 0), ([1, 2, 9, 4], 2), ([1, 2, 3, 9], 3), ([1, 2], 2)],
)
def test_agreement_counts_tokens_before_the_first_difference(other, expected):
    assert agreement([1, 2, 3, 4], other) == expected


def test_decode_speeds_from_timestamps():
    stamps = [10.0, 10.5, 10.6, 10.7, 10.8]  # a slow first step, then 0.1 s per token
    assert per_token_seconds(stamps) == pytest.approx(0.2)
    assert median_step_seconds(stamps) == pytest.approx(0.1)
    assert median_step_seconds([1.0]) == 0.0
