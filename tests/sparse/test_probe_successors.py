"""Probe's successor spreading: the block after an attended block is kept too.

Injected: block scores where one block (a needle's start) scores far above the rest and the block
after it (where the needle's number continues) scores low.
Must happen: spreading lifts the successor to ``share`` x its predecessor's score, so it ranks right
after the needle's block (into a top-2 it would miss otherwise); every other score is unchanged;
share 0 changes nothing.
"""

from __future__ import annotations

import torch

from semkv.sparse.probe import spread_successors


def test_successor_of_an_attended_block_is_lifted_into_the_top_k():
    scores = torch.tensor([0.03, 0.02, 0.80, 0.01, 0.10, 0.06])  # block 2: the needle's start
    spread = spread_successors(scores, 0.5)
    assert torch.topk(scores, 2).indices.sort().values.tolist() == [2, 4]  # without: block 3 missed
    assert torch.topk(spread, 2).indices.sort().values.tolist() == [2, 3]
    assert spread[3] == 0.5 * scores[2]
    others = [0, 1, 2, 4, 5]  # each already above half its predecessor's score
    assert torch.equal(spread[others], scores[others])


def test_no_share_changes_nothing():
    scores = torch.rand(9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(spread_successors(scores, 0.0), scores)
    assert torch.equal(spread_successors(scores[:1], 0.5), scores[:1])
