"""A shared prefix made of pooled pages is read in place, and a cache allocates only the rows it owns.

Injected: pages written to the pool in one run of consecutive ids and in scattered ids; a shared prefix
made of each; a cache reading the prefix that then writes into a prefix row; the prefix's values asked
in float32 (what a batched step of several readers does); fresh caches made for 100 rows, one filled
from row 0 and one started from a shared prefix.

Must happen: over consecutive pages the prefix's rotated keys, values and pre-RoPE keys are views of the
pool's buffers (no copy), over scattered pages gathered copies; both read back bit-identical to the
rows written. A reader writing into a prefix row copies the prefix in first and leaves the pool's rows
as they were. Widening the values to float32 keeps the same values and the prefix's byte count follows
(compute-dtype rows before, float32 after). A new cache allocates no rows until rows arrive (its byte
count is the rows it was made for meanwhile); one started from a shared prefix allocates only the rows
after the prefix.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models.cache import KVCache
from tests.models.test_page_pool_rows import BLOCK, DIM, HEADS, LAYERS, pool_for, publish, random_cache

KV, COMPUTE = torch.float16, torch.bfloat16


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _pooled(page_ids: list[int]):
    source = random_cache(len(page_ids) * BLOCK, KV, COMPUTE, seed=len(page_ids))
    pool = pool_for(source, 12)
    pool.table.refs = [1] * pool.num_pages  # held by this test: publish needs held pages
    pool.write(page_ids, source, 0)
    publish(pool, page_ids, source)
    return source, pool


@pytest.mark.parametrize(
    ("page_ids", "in_place"), [([3, 4, 5, 6], True), ([3, 9, 4, 0], False)], ids=["consecutive", "scattered"]
)
def test_prefix_rows_are_the_pool_rows_read_in_place_when_pages_are_consecutive(page_ids, in_place):
    source, pool = _pooled(page_ids)
    count = len(page_ids) * BLOCK - 2  # a partial last page
    prefix, readable = pool.shared_prefix(page_ids, count)
    assert (prefix.rows, readable) == (count, count)
    for layer in range(LAYERS):
        pairs = (
            (prefix.k_rot[layer], pool.k_rot[layer], source.k_rot[layer]),
            (prefix.v[layer], pool.v[layer], source.v[layer]),
            (prefix.k_pre_rows(layer, 1, count), pool.k_pre[layer], source.k_pre[layer][:, 1:]),
        )
        for rows, pooled, written in pairs:
            assert _same_storage(rows, pooled) == in_place
            assert torch.equal(rows, written[:, : rows.shape[1]])


def test_a_reader_writing_a_prefix_row_leaves_the_pool_rows_alone():
    source, pool = _pooled([3, 4, 5])
    prefix, _ = pool.shared_prefix([3, 4, 5], 3 * BLOCK)
    written = slice(3 * BLOCK, 6 * BLOCK)  # the other pages were never written (uninitialised memory)
    before = [buf[:, written].clone() for buf in (*pool.k_pre, *pool.k_rot, *pool.v)]
    reader = KVCache(LAYERS, HEADS, DIM, 3 * BLOCK + 4, KV, COMPUTE)
    reader.share_prefix(prefix)
    ones = torch.ones(HEADS, 1, DIM)
    reader.write(0, slice(2, 3), ones, ones, ones)  # a prefix row: the reader copies the prefix in first
    assert reader.prefix is None
    assert torch.equal(reader.keys(0)[:, 2:3], ones.to(COMPUTE))
    assert torch.equal(reader.keys(1), source.k_rot[1][:, : 3 * BLOCK])
    after = [buf[:, written] for buf in (*pool.k_pre, *pool.k_rot, *pool.v)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_float_values_widen_once_and_are_counted():
    source, pool = _pooled([0, 1])
    prefix, _ = pool.shared_prefix([0, 1], 2 * BLOCK)
    elements = LAYERS * HEADS * 2 * BLOCK * DIM
    assert prefix.nbytes() == elements * (2 + 2)  # rotated keys and values in bf16
    widened = prefix.float_values(1)
    assert widened.dtype == torch.float32 and all(t.dtype == torch.float32 for t in prefix.v)
    assert torch.equal(widened, source.v[1][:, : 2 * BLOCK].float())
    assert prefix.float_values(1) is widened  # once
    assert prefix.nbytes() == elements * (2 + 4)


def test_a_cache_allocates_its_rows_when_they_arrive_and_only_those_it_owns():
    fresh = KVCache(LAYERS, HEADS, DIM, 100, KV, COMPUTE)
    assert all(buf.shape[1] == 0 for buf in (*fresh.own_k_pre, *fresh.own_k_rot, *fresh.own_v))
    assert fresh.held_bytes() == 100 * fresh.row_bytes  # what it was made for, before it holds it
    fresh.append_rows(torch.arange(3), [1, 2, 3])
    assert fresh.capacity == 100 and fresh.own_k_rot[0].shape[1] == 100
    assert torch.count_nonzero(fresh.own_v[2][:, 3:]) == 0  # rows past the length are finite (zeros)

    _, pool = _pooled([3, 4, 5])
    prefix, _ = pool.shared_prefix([3, 4, 5], 3 * BLOCK)
    reader = KVCache(LAYERS, HEADS, DIM, 100, KV, COMPUTE)
    reader.share_prefix(prefix)
    own = 100 - 3 * BLOCK
    assert reader.capacity == 100
    assert all(buf.shape[1] == own for buf in (*reader.own_k_pre, *reader.own_k_rot, *reader.own_v))
    assert reader.held_bytes() == own * reader.row_bytes
