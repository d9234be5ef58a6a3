"""The Grid -> Chunk -> Page hierarchy on hand-built summaries selects exactly the expected pages.

Injected: 8 two-dimensional page summaries (2 pages per chunk, 2 chunks per grid) whose grid and
chunk means are known, including a page that matches the anchor perfectly inside a grid that does
not. Must happen: children of unkept parents are masked (-inf), the kept pages are exactly the
expected ones, and affinities are (cos + 1) / 2.
"""

from __future__ import annotations

import math

import pytest
import torch

from semkv.sparse import hierarchical_scores
from semkv.sparse.keykey import group_mean

PAGES = torch.tensor(
    [
        [1.0, 0.1],  # chunk 0 (mean (1, 0): cos 1)      } grid 0: mean (0.5, 0.5), cos 0.707
        [1.0, -0.1],
        [0.0, 1.0],  # chunk 1 (mean (0, 1): cos 0)
        [0.0, 1.0],
        [1.0, 0.0],  # chunk 2 (mean (0.1, 0.1): cos 0.707) } grid 1: mean (-0.45, 0.05), cos -0.99
        [-0.8, 0.2],  #   page 4 matches the anchor perfectly
        [-1.0, 0.0],  # chunk 3 (mean (-1, 0): cos -1)
        [-1.0, 0.0],
    ]
)
ANCHOR = torch.tensor([1.0, 0.0])


def _kept(scores: torch.Tensor) -> set[int]:
    return set(torch.isfinite(scores).nonzero().squeeze(1).tolist())


@pytest.mark.parametrize(
    "keep_grids, keep_chunks, expected",
    [
        (1, 1, {0, 1}),  # grid 1 dropped: page 4 masked although its affinity is 1
        (1, 2, {0, 1, 2, 3}),
        (2, 1, {0, 1}),
        (2, 2, {0, 1, 4, 5}),  # chunk 2 (0.707) beats chunk 1 (0.0)
        (2, 4, set(range(8))),
    ],
)
def test_masks_select_expected_pages(keep_grids, keep_chunks, expected):
    scores, chunk_keep, grid_keep = hierarchical_scores(PAGES, ANCHOR, 2, 2, keep_grids, keep_chunks)
    assert _kept(scores) == expected
    assert int(grid_keep.sum()) == keep_grids and int(chunk_keep.sum()) == min(keep_chunks, 4)
    # parent masks are consistent: a kept chunk's grid is kept
    assert all(bool(grid_keep[c // 2]) for c in chunk_keep.nonzero().squeeze(1).tolist())


def test_affinity_is_half_cos_plus_one():
    scores, _, _ = hierarchical_scores(PAGES, ANCHOR, 2, 2, 2, 4)
    cos = torch.nn.functional.cosine_similarity(PAGES, ANCHOR.expand_as(PAGES), dim=1)
    torch.testing.assert_close(scores, (cos + 1) / 2)
    assert math.isclose(float(scores[4]), 1.0, abs_tol=1e-6)


def test_layerwise_batch_is_independent():
    """A leading dim (layers) scores each problem on its own."""
    flipped = -PAGES
    scores, _, _ = hierarchical_scores(torch.stack([PAGES, flipped]), ANCHOR.expand(2, 2), 2, 2, 1, 1)
    assert _kept(scores[0]) == {0, 1}
    assert _kept(scores[1]) == {6, 7}


def test_group_mean_handles_a_short_last_group():
    x = torch.arange(10.0).view(5, 2)
    torch.testing.assert_close(group_mean(x, 2), torch.tensor([[1.0, 2.0], [5.0, 6.0], [8.0, 9.0]]))
