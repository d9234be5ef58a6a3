"""store_prefix exports the rows of the blocks it writes in one piece and copies each block out.

Checked on a tiny model with bf16 compute and fp16 KV (the cast path the one-piece export saves):
every stored block holds exactly the KV a per-block export gives, owns its memory (not a view of the
one-piece export, which would keep the whole prompt alive as long as any block is cached), and a
second call writes only the blocks missing from the store, with a gap between them.
"""

from __future__ import annotations

import torch

from semkv.reuse.prefix import store_prefix
from semkv.store import prefix_block_keys


def owns_its_memory(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_blocks_are_exported_exactly_and_own_their_memory(make_tiny_engine):
    engine = make_tiny_engine("llama", kv_dtype="float16", compute_dtype="bfloat16", block_size=4)
    ids = list(range(3, 3 + 4 * 6 + 2))  # six full blocks and two rows more
    cache = engine.runtime.new_cache(len(ids))
    engine.runtime.prefill(cache, ids)
    keys = prefix_block_keys(engine.fingerprint, 4, ids)
    assert store_prefix(engine.ctx, cache, ids) == 6
    for index, key in enumerate(keys):
        entry = engine.store.get(key)
        k, v = cache.export(index * 4, (index + 1) * 4)
        assert entry is not None and torch.equal(entry.k, k) and torch.equal(entry.v, v)
        assert owns_its_memory(entry.k) and owns_its_memory(entry.v)
        assert entry.token_ids == ids[index * 4 : (index + 1) * 4]
        assert entry.parent == (keys[index - 1] if index else None)

    for index in (1, 4):  # two blocks lost from every tier, with stored ones between them
        engine.store.delete(keys[index])
    puts = engine.store.stats.puts
    assert store_prefix(engine.ctx, cache, ids) == 2
    assert engine.store.stats.puts == puts + 2
    for index in (1, 4):
        entry = engine.store.get(keys[index])
        k, v = cache.export(index * 4, (index + 1) * 4)
        assert entry is not None and torch.equal(entry.k, k) and torch.equal(entry.v, v)
        assert owns_its_memory(entry.k)
    assert store_prefix(engine.ctx, cache, ids) == 0
