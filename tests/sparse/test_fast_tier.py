"""The fast tier's slot bookkeeping, driven directly.

Injected: a cache of 12 blocks of 4 rows (1 layer, distinct values per row), a tier of 4 slots, and a
sequence of selections: [1, 2, 3]; then [1, 2] with block 3 kept resident by the hint (no copy, but the
selection changed); then [1, 2, 3] again (block 3 still resident: no copy); then [4, 5, 6, 7] (evicts).
Must happen: after each call exactly the selected blocks' rows are visible (their positions, their keys),
hidden rows carry the far-future position, copies are counted only for blocks that were not resident,
and the mask handed to the runtime hides exactly the hidden rows.
"""

from __future__ import annotations

import torch

from semkv.models.cache import KVCache
from semkv.sparse.tier import HIDDEN, FastTier

BLOCK = 4


def make_cache() -> KVCache:
    cache = KVCache(1, 1, 2, 12 * BLOCK + 8, torch.float32, torch.float32, torch.device("cpu"))
    rows = 12 * BLOCK
    cache.append_rows(torch.arange(rows), list(range(rows)))
    k = torch.arange(rows, dtype=torch.float32).view(1, rows, 1).expand(1, rows, 2)
    cache.write(0, slice(0, rows), k, k, k)
    return cache


def visible_blocks(tier: FastTier, cache: KVCache) -> set[int]:
    positions = tier.positions[0, : tier.slot_rows]
    seen = positions[positions != HIDDEN]
    keys = tier.k[0, 0, : tier.slot_rows, 0][positions != HIDDEN]
    assert torch.equal(keys, seen.float())  # a visible row holds the key of the cache row at its position
    return set((seen // BLOCK).tolist())


def test_visible_rows_follow_every_selection_change():
    cache = make_cache()
    tier = FastTier(cache, BLOCK, slots=4, hot_rows=8)
    tier.set_window(cache, cache.length)  # an empty window: only slots are visible
    assert tier.ensure(0, [1, 2, 3], cache) == 3
    assert visible_blocks(tier, cache) == {1, 2, 3}
    assert tier.ensure(0, [1, 2], cache, extra=torch.tensor([3])) == 0  # 3 stays resident, hidden
    assert visible_blocks(tier, cache) == {1, 2} and set(tier.resident(0)) == {1, 2, 3}
    assert tier.ensure(0, [1, 2, 3], cache) == 0  # re-selected while resident: no copy
    assert visible_blocks(tier, cache) == {1, 2, 3}
    assert tier.ensure(0, [4, 5, 6, 7], cache) == 4
    assert visible_blocks(tier, cache) == {4, 5, 6, 7} and set(tier.resident(0)) == {4, 5, 6, 7}
    picked = tier.view(0, cache)
    hidden = (picked.positions == HIDDEN).tolist()
    assert picked.mask_known
    assert (picked.bias.isinf()[0].tolist() == hidden) if picked.bias is not None else not any(hidden)
