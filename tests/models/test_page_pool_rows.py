"""Rows in and out of the page pool's tensors, with no model: a page holds exactly the cache rows it was
written from, whatever the page ids are.

Injected: caches of random rows in bf16 compute / fp16 KV (and fp32), written to pages in one run, in
scattered runs, and in more runs than MANY_RUNS (the gather / scatter path); reads of whole pages and of
a partial last page. Must happen: every buffer (pre-RoPE keys, rotated keys, values) of every layer
reads back bit-identical at the rows' positions 0.., with the pages' token ids; reading into a
non-empty cache, or more rows than the pages hold, is an error.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models.cache import KVCache
from semkv.models.page_pool import MANY_RUNS, PageInfo, PageLayout, PagePool

LAYERS, HEADS, DIM, BLOCK = 3, 2, 8, 4


def random_cache(rows: int, kv_dtype: torch.dtype, compute_dtype: torch.dtype, seed: int) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(LAYERS, HEADS, DIM, rows, kv_dtype, compute_dtype)
    cache.append_rows(torch.arange(rows), list(range(100, 100 + rows)))
    for layer in range(LAYERS):
        for buf in (cache.k_pre, cache.k_rot, cache.v):
            buf[layer][:, :rows] = torch.randn(HEADS, rows, DIM, generator=gen).to(buf[layer].dtype)
    return cache


def pool_for(cache: KVCache, pages: int) -> PagePool:
    return PagePool(PageLayout.of_cache(cache, BLOCK), pages)


def publish(pool: PagePool, pages: list[int], cache: KVCache) -> None:
    for index, page in enumerate(pages):
        tokens = tuple(cache.token_ids[index * BLOCK : (index + 1) * BLOCK])
        pool.table.publish(page, PageInfo(f"k{index}", tokens, f"d{index}"))


def assert_same_rows(a: KVCache, b: KVCache, count: int) -> None:
    assert a.length == count <= b.length
    assert a.token_ids == b.token_ids[:count]
    assert torch.equal(a.valid_positions(), torch.arange(count))
    for layer in range(LAYERS):
        for left, right in ((a.k_pre, b.k_pre), (a.k_rot, b.k_rot), (a.v, b.v)):
            assert torch.equal(left[layer][:, :count], right[layer][:, :count])


@pytest.mark.parametrize(
    "dtypes", [(torch.float16, torch.bfloat16), (torch.float32, torch.float32)], ids=["fp16-bf16", "fp32"]
)
@pytest.mark.parametrize(
    "page_ids",
    [[0, 1, 2, 3, 4], [7, 8, 2, 3, 5], list(range(2 * (MANY_RUNS + 2), 0, -2))],
    ids=["one-run", "three-runs", "gather"],
)
def test_pages_read_back_exactly_what_was_written(dtypes, page_ids):
    blocks = len(page_ids)
    source = random_cache(blocks * BLOCK + 3, *dtypes, seed=len(page_ids))
    pool = pool_for(source, 2 * (MANY_RUNS + 2) + 1)
    pool.table.refs = [1] * pool.num_pages  # held by this test: publish needs held pages
    pool.write(page_ids, source, 0)
    publish(pool, page_ids, source)
    for count in (blocks * BLOCK, blocks * BLOCK - 3):  # whole pages, then a partial last page
        target = KVCache(LAYERS, HEADS, DIM, 1, *dtypes)
        assert pool.read(page_ids, target, count) == 0
        assert_same_rows(target, source, count)


def test_write_from_a_later_row_and_read_a_single_page():
    source = random_cache(4 * BLOCK, torch.float16, torch.bfloat16, seed=3)
    pool = pool_for(source, 4)
    pool.table.refs = [1] * 4
    pool.write([3], source, 0)
    pool.write([1, 2], source, BLOCK)  # blocks 1 and 2 of the cache into pages 1, 2
    publish(pool, [3, 1, 2], source)
    target = KVCache(LAYERS, HEADS, DIM, 1, torch.float16, torch.bfloat16)
    pool.read([3, 1, 2], target, 3 * BLOCK)
    assert_same_rows(target, source, 3 * BLOCK)


def test_bad_reads_and_writes_are_errors():
    source = random_cache(2 * BLOCK, torch.float32, torch.float32, seed=1)
    pool = pool_for(source, 2)
    with pytest.raises(ValueError, match="holds no pages"):
        pool.read([0], KVCache(LAYERS, HEADS, DIM, 1, torch.float32, torch.float32), BLOCK)
    pool.table.refs = [1, 1]
    with pytest.raises(ValueError, match="does not hold every row"):
        pool.write([0, 1], source, BLOCK)
    pool.write([0, 1], source, 0)
    publish(pool, [0, 1], source)
    with pytest.raises(ValueError, match="must hold 0 rows"):
        pool.read([0], source, BLOCK)
    with pytest.raises(ValueError, match=f"rows 0..{BLOCK + 1} asked"):
        pool.read([0], KVCache(LAYERS, HEADS, DIM, 1, torch.float32, torch.float32), BLOCK + 1)
    assert pool.nbytes() == 2 * pool.layout.page_bytes
