"""A prefix lookup over a long chain touches the memory tier's LRU order once per block, leaves first.

Injected: a chain of 200 prefix blocks in a memory-only store (no model), looked up through
``lookup_prefix`` as a prompt's prefix hit does, with the tier's LRU order counting its moves. Must happen:
the lookup makes at most two LRU moves per block (the old per-get walk over every ancestor made ~n^2/2 =
~20,000), every block is found, and afterwards the chain is ordered root most recent, so eviction takes
the leaves first (the exact order is asserted on a small chain).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from semkv.reuse.prefix import lookup_prefix
from semkv.store import EntryKind, KVEntry, KVStore, MemoryTier, prefix_block_keys
from semkv.store.keys import PREFIX_DIGEST_META, prefix_digests

FP = "f" * 64
BLOCK = 2


class CountingOrder(OrderedDict):
    """The tier's LRU order, counting ``move_to_end`` calls."""

    moves = 0

    def move_to_end(self, key, last=True):  # noqa: ANN001, ANN201 (OrderedDict's signature)
        CountingOrder.moves += 1
        return super().move_to_end(key, last)


def _chain_store(blocks: int) -> tuple[KVStore, MemoryTier, list[int], list[str]]:
    tokens = list(range(10, 10 + BLOCK * blocks))
    keys = prefix_block_keys(FP, BLOCK, tokens)
    digests = prefix_digests(FP, BLOCK, tokens)
    tier = MemoryTier(budget_bytes=1 << 30)
    store = KVStore([tier], FP)
    g = torch.Generator().manual_seed(0)
    for i, key in enumerate(keys):
        k = torch.randn(2, 1, BLOCK, 4, generator=g).half()
        v = torch.randn(2, 1, BLOCK, 4, generator=g).half()
        ids = tokens[i * BLOCK : (i + 1) * BLOCK]
        parent = keys[i - 1] if i else None
        meta = {PREFIX_DIGEST_META: digests[i]}
        entry = KVEntry(key, EntryKind.BLOCK, FP, ids, k, v, block_size=BLOCK, parent=parent, meta=meta)
        assert store.put(entry, chain=False)
    store.touch_chain(keys)
    return store, tier, tokens, keys


def test_a_chain_lookup_moves_each_block_a_bounded_number_of_times():
    store, tier, tokens, keys = _chain_store(200)
    tier._entries = CountingOrder(tier._entries)  # count the LRU moves of the lookup alone
    CountingOrder.moves = 0
    found = lookup_prefix(store, BLOCK, tokens)
    assert [e.key for e in found] == keys
    assert CountingOrder.moves <= 2 * len(keys), CountingOrder.moves


def test_after_a_lookup_the_root_is_most_recent_and_leaves_go_first():
    store, tier, tokens, keys = _chain_store(4)
    other = KVEntry(
        "0" * 64, EntryKind.CHUNK, FP, [1, 2], *(torch.zeros(2, 1, 2, 4).half() for _ in range(2))
    )
    assert tier.put(other)  # newest of all before the lookup
    lookup_prefix(store, BLOCK, tokens)
    assert list(tier.keys()) == [other.key, keys[3], keys[2], keys[1], keys[0]]
    tier.check_invariants()
