"""The page table's bookkeeping on tiny pools, with no model: exact page ids, reference counts, the
order pages are handed out in and the order they are evicted in (like vLLM's block-pool tests).

Injected: chains of pages published, released, touched, looked up, leased, forgotten, on pools of a
few pages. Must happen: freed pages are handed out before never-used ones, lowest id first; cached
pages are evicted least recently used first, a chain's leaves before its root; pages someone refers
to are never evicted; asking for more than is free or evictable raises PoolFull and hands out
nothing; every step leaves the table's invariants true.
"""

from __future__ import annotations

import gc

import pytest

from semkv.models.page_pool import PageInfo, PageTable, PoolFull, page_runs

BLOCK = 2


def info(key: str, tokens: tuple[int, ...] = (1, 2), digest: str = "d") -> PageInfo:
    return PageInfo(key, tokens, digest)


def cache_chain(table: PageTable, keys: list[str]) -> list[int]:
    """Allocate, publish and release a chain (leaf first) as publish_prefix does; returns its pages."""
    pages = table.allocate(len(keys))
    for page, key in zip(pages, keys, strict=True):
        table.publish(page, info(key))
    table.release(list(reversed(pages)))
    table.check_invariants()
    return pages


def test_fresh_pages_come_in_id_order():
    table = PageTable(5)
    assert table.allocate(2) == [0, 1]
    assert table.allocate(2) == [2, 3]
    assert table.refs == [1, 1, 1, 1, 0]
    table.check_invariants()


def test_freed_pages_are_handed_out_before_never_used_ones_lowest_first():
    table = PageTable(6)
    assert table.allocate(4) == [0, 1, 2, 3]
    table.release([3, 1])  # unpublished pages go back to the free heap
    table.check_invariants()
    assert table.allocate(3) == [1, 3, 4]


def test_cached_pages_are_evicted_least_recently_used_leaf_first():
    table = PageTable(4)
    assert cache_chain(table, ["a0", "a1"]) == [0, 1]
    assert cache_chain(table, ["b0", "b1"]) == [2, 3]
    assert list(table.cached) == [1, 0, 3, 2]  # each chain released leaf first
    table.touch([1, 0])  # chain a used again, leaf first
    assert list(table.cached) == [3, 2, 1, 0]
    assert table.allocate(1) == [3]  # b's leaf goes first
    assert table.lookup("b1") is None and table.lookup("b0") == 2
    assert table.evictions == 1
    assert table.allocate(2) == [1, 2]  # then b's root, then a's leaf
    assert table.lookup("a0") == 0 and table.lookup("a1") is None
    table.check_invariants()


def test_referenced_pages_are_never_evicted_and_full_raises_without_handing_out():
    table = PageTable(3)
    cache_chain(table, ["a0", "a1", "a2"])
    lease = [0, 1]
    table.acquire(lease)
    with pytest.raises(PoolFull, match="1 of 3"):
        table.allocate(2)
    table.check_invariants()
    assert table.available() == 1
    assert table.allocate(1) == [2]  # the only evictable page
    table.release(list(reversed(lease)))
    assert list(table.cached) == [1, 0]
    table.check_invariants()


def test_lookup_chain_stops_at_a_miss_or_other_tokens():
    table = PageTable(4)
    pages = table.allocate(3)
    for index, page in enumerate(pages):
        table.publish(page, PageInfo(f"k{index}", (index, index), f"d{index}"))
    tokens = [0, 0, 1, 1, 2, 2]
    digests = ["d0", "d1", "d2"]
    assert table.lookup_chain(["k0", "k1", "k2"], tokens, digests, BLOCK) == [0, 1, 2]
    assert table.lookup_chain(["k0", "kx", "k2"], tokens, digests, BLOCK) == [0]
    assert table.lookup_chain(["k0", "k1"], [0, 0, 9, 1], digests, BLOCK) == [0]  # other tokens
    assert table.lookup_chain(["k0", "k1"], tokens, ["d0", "other"], BLOCK) == [0]  # other digest


def test_forget_frees_an_unreferenced_page_and_defers_a_referenced_one():
    table = PageTable(3)
    cache_chain(table, ["a0", "a1"])
    table.acquire([1])
    assert table.forget("a0") and table.forget("a1")
    assert not table.forget("a0")
    assert table.free == [0]
    table.check_invariants()
    table.release([1])  # its holder is done: now free, not cached
    assert sorted(table.free) == [0, 1] and not table.cached
    assert table.allocate(3) == [0, 1, 2]


def test_publish_keeps_the_first_page_of_a_key():
    table = PageTable(3)
    first, second = table.allocate(2)
    table.publish(first, info("k"))
    table.publish(second, info("k"))
    assert table.lookup("k") == first
    table.release([second, first])
    assert table.free == [second] and list(table.cached) == [first]
    table.check_invariants()


def test_a_lease_holds_its_pages_until_released_or_collected():
    from semkv.models.page_pool import PageLease

    table = PageTable(2)
    cache_chain(table, ["a0", "a1"])
    lease = PageLease(table, [0, 1])
    assert table.refs == [1, 1] and not table.cached
    lease.release()
    lease.release()  # once only
    assert table.refs == [0, 0] and list(table.cached) == [1, 0]
    dropped = PageLease(table, [0])
    del dropped
    gc.collect()
    assert table.refs == [0, 0]
    table.check_invariants()


def test_bad_ids_and_double_release_are_errors():
    table = PageTable(2)
    with pytest.raises(ValueError, match="outside"):
        table.acquire([2])
    with pytest.raises(ValueError, match="not held and not cached"):
        table.acquire([0])
    pages = table.allocate(1)
    table.release(pages)
    with pytest.raises(ValueError, match="released more often"):
        table.release(pages)
    with pytest.raises(ValueError, match="must be held"):
        table.publish(1, info("x"))


def test_clear_forgets_every_key():
    table = PageTable(3)
    cache_chain(table, ["a0", "a1", "a2"])
    table.clear()
    assert not table.page_of and not table.cached and sorted(table.free) == [0, 1, 2]
    table.check_invariants()


def test_page_runs_groups_consecutive_ids():
    assert page_runs([]) == []
    assert page_runs([4, 5, 6, 9, 2, 3]) == [(4, 0, 3), (9, 3, 1), (2, 4, 2)]
