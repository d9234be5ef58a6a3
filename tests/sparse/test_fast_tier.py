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


def test_view_is_the_whole_buffer_with_the_unused_hot_rows_hidden():
    """The runtime's batched matmul copies a leading slice of a buffer first, so the view must be the
    layer's whole contiguous buffer; the hot rows the sink and window do not use are hidden by the mask."""
    cache = make_cache()
    tier = FastTier(cache, BLOCK, slots=4, hot_rows=8)
    tier.set_sink(cache, BLOCK)
    tier.set_window(cache, cache.length - 2)  # sink 4 + window 2 of 8 hot rows: 2 unused
    tier.ensure(0, [2, 5], cache)
    picked = tier.view(0, cache)
    assert picked.keys.is_contiguous() and picked.values.is_contiguous()
    assert picked.keys.shape[1] == tier.slot_rows + tier.hot_rows == picked.positions.numel()
    unused = slice(tier.slot_rows + 6, tier.slot_rows + 8)
    assert (picked.positions[unused] == HIDDEN).all()
    assert picked.bias is not None and picked.bias[0, unused].isinf().all()
    seen = picked.positions[picked.bias[0] == 0]
    expected = [*range(0, BLOCK), *range(2 * BLOCK, 3 * BLOCK), *range(5 * BLOCK, 6 * BLOCK)]
    assert sorted(seen.tolist()) == [*expected, cache.length - 2, cache.length - 1]
