"""The stability filter on hand-built affinity sequences.

Injected: affinities per step for a few blocks. Must happen: stability = share of the last
``window`` steps above ``threshold``; one-step spikes do not make a block resident, steady
high affinity does (the seed's example: 0.9 once then 0.2 x 19 -> 0.05; 0.6 x 20 -> 1.0).
"""

from __future__ import annotations

import pytest
import torch

from semkv.sparse import StabilityFilter


def test_sliding_window_scores():
    f = StabilityFilter(window=4, threshold=0.5, keep_at=0.5)
    steps = [[0.9, 0.2, 0.6], [0.2, 0.2, 0.6], [0.2, 0.9, 0.6], [0.2, 0.2, 0.6], [0.2, 0.2, 0.6]]
    expected = [[1, 0, 1], [0.5, 0, 1], [1 / 3, 1 / 3, 1], [0.25, 0.25, 1], [0.0, 0.25, 1]]
    for affinity, want in zip(steps, expected, strict=True):
        got = f.update(torch.tensor(affinity))
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))
    assert f.keep().tolist() == [False, False, True]


def test_seed_example_spike_vs_steady():
    f = StabilityFilter(window=20, threshold=0.5)
    for step in range(20):
        f.update(torch.tensor([0.9 if step == 0 else 0.2, 0.6]))
    torch.testing.assert_close(f.scores(), torch.tensor([0.05, 1.0]))
    assert f.keep().tolist() == [False, True]


def test_new_blocks_join_without_history():
    f = StabilityFilter(window=3, threshold=0.5)
    f.update(torch.tensor([0.9]))
    got = f.update(torch.tensor([0.9, 0.9]))
    torch.testing.assert_close(got, torch.tensor([1.0, 0.5]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": 0}, "stability window must be >= 1"),
        ({"threshold": 1.5}, "threshold and keep_at must be in"),
        ({"keep_at": -0.1}, "threshold and keep_at must be in"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StabilityFilter(**kwargs)
