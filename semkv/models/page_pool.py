"""The page pool: the hot tier of exact prefix KV, kept in the live cache's own format on the device.

A page is one prefix block: ``block_size`` token rows over every layer, holding what a live cache holds
for those rows (pre-RoPE keys in the KV dtype, rotated keys and values in the compute dtype), at the
block's own positions (a prefix block always sits at the same positions). A prefix hit on pooled pages
is therefore a plain copy into the new sequence's cache — no verification of tensors, no cast, no
re-rotation — one copy per layer and buffer for each run of consecutive pages.

Two parts, as in vLLM v1's block pool:

- :class:`PageTable`, model-free bookkeeping: reference counts, the key -> page index, the order in
  which pages are handed out and evicted. Pages a lease refers to are never evicted. Freed pages
  (never indexed, or forgotten) are handed out first, lowest id first (their memory is already
  touched), then pages never used, in id order, then cached pages no one refers to, least recently used
  first; a chain is released and touched leaf first, so its leaves are evicted before its root.
- :class:`PagePool`, the tensors: per layer ``[kvh, num_pages * block_size, d]`` for each buffer,
  allocated on first use, and the bulk copies between them and a :class:`~semkv.models.cache.KVCache`.

Tenancy: a page is found only through its key, and a prefix block's key includes the request's
namespace (:func:`semkv.store.keys.prefix_block_keys`), so a tenant reaches only its own pages; a page
handed out again is overwritten whole before it is indexed under its new key.

Sequences still copy the pages they hit into their own cache (the decode arena is contiguous per
sequence): running sequences do not share pages, and there is no copy-on-write (docs/design.md).
"""

from __future__ import annotations

import heapq
import logging
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.models.cache import KVCache, row_bytes

log = logging.getLogger(__name__)

MANY_RUNS = 4  # more runs of consecutive pages than this: one indexed gather / scatter per buffer instead


class PoolFull(RuntimeError):
    """The pool cannot hand out the pages asked for: every page is referred to."""


@dataclass(frozen=True)
class PageLayout:
    """The shape of one page: ``block_size`` rows of a live cache over every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: torch.dtype
    compute_dtype: torch.dtype
    device: torch.device

    @classmethod
    def of_cache(cls, cache: KVCache, block_size: int) -> PageLayout:
        return cls(
            cache.num_layers,
            cache.num_kv_heads,
            cache.head_dim,
            block_size,
            cache.kv_dtype,
            cache.compute_dtype,
            cache.device,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes (every layer, the three buffers)."""
        per_row = row_bytes(
            self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype, self.compute_dtype
        )
        return self.block_size * per_row

    def within(self, budget_bytes: int) -> int:
        """How many pages fit in ``budget_bytes``."""
        return max(0, budget_bytes // self.page_bytes)


@dataclass
class PageInfo:
    """What a cached page holds: its key, its tokens, the digest of every token up to its end (checked
    on a hit, as a stored block's is), and small extras (the block's sparse summaries)."""

    key: str
    token_ids: tuple[int, ...]
    digest: str
    extras: dict[str, Tensor] = field(default_factory=dict)


class PageTable:
    """Reference counts, the key index and the hand-out / eviction order of ``num_pages`` pages.

    A page is in one of four states: referred to (``refs > 0``; indexed or not), cached (indexed, no
    reference: in the LRU order, evictable), free (not indexed, no reference: in the free heap), or never
    used (ids from :attr:`next_fresh` on).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.info: list[PageInfo | None] = [None] * num_pages
        self.page_of: dict[str, int] = {}
        self.free: list[int] = []  # min-heap of freed page ids
        self.next_fresh = 0  # pages from here on were never handed out
        self.cached: OrderedDict[int, None] = OrderedDict()  # evictable, least recently used first
        self.evictions = 0

    # -- finding pages -----------------------------------------------------------------------------
    def lookup(self, key: str) -> int | None:
        """The page indexed under ``key``, or None."""
        return self.page_of.get(key)

    def lookup_chain(
        self, keys: Sequence[str], token_ids: Sequence[int], digests: Sequence[str], block_size: int
    ) -> list[int]:
        """The pages of the longest run of ``keys`` from the first that the pool holds, each checked
        against its block of ``token_ids`` and its digest (a mismatch ends the run)."""
        pages: list[int] = []
        for index, key in enumerate(keys):
            page = self.page_of.get(key)
            if page is None:
                break
            info = self.info[page]
            expect = tuple(token_ids[index * block_size : (index + 1) * block_size])
            if info is None or info.token_ids != expect or info.digest != digests[index]:
                log.warning("page %d under key %s holds other tokens: treated as a miss", page, key[:12])
                break
            pages.append(page)
        return pages

    # -- references --------------------------------------------------------------------------------
    def acquire(self, pages: Sequence[int]) -> None:
        """One more reference to each page (a cached page leaves the eviction order)."""
        for page in pages:
            self._check_id(page)
            if self.refs[page] == 0:
                if self.info[page] is None:
                    raise ValueError(f"page {page} is not held and not cached")
                self.cached.pop(page, None)
            self.refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One reference less to each page, in the order given (pass a chain leaf first): a page left with
        none becomes cached (evictable, most recently used) if indexed, else free."""
        for page in pages:
            self._check_id(page)
            if self.refs[page] <= 0:
                raise ValueError(f"page {page} released more often than acquired")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if self.info[page] is not None:
                    self.cached[page] = None
                else:
                    heapq.heappush(self.free, page)

    def touch(self, pages: Sequence[int]) -> None:
        """Mark cached pages most recently used, in the order given (pass a chain leaf first, so the
        root ends most recent and is evicted last)."""
        for page in pages:
            if page in self.cached:
                self.cached.move_to_end(page)

    # -- handing out -------------------------------------------------------------------------------
    def available(self) -> int:
        """Pages :meth:`allocate` could hand out now."""
        return len(self.free) + (self.num_pages - self.next_fresh) + len(self.cached)

    def allocate(self, count: int) -> list[int]:
        """``count`` pages with one reference each, sorted by id: freed pages first, then never-used
        ones, then cached pages evicted least recently used first (their keys forgotten). Raises
        :class:`PoolFull` (and hands out nothing) if fewer are available."""
        if count > self.available():
            raise PoolFull(
                f"the page pool has {self.available()} of {self.num_pages} pages free or evictable; "
                f"{count} asked for"
            )
        pages: list[int] = []
        while len(pages) < count and self.free:
            pages.append(heapq.heappop(self.free))
        while len(pages) < count and self.next_fresh < self.num_pages:
            pages.append(self.next_fresh)
            self.next_fresh += 1
        while len(pages) < count:
            page, _ = self.cached.popitem(last=False)
            self._unindex(page)
            self.evictions += 1
            pages.append(page)
        for page in pages:
            self.refs[page] = 1
        return sorted(pages)

    def publish(self, page: int, info: PageInfo) -> None:
        """Index a page this caller holds (filled with ``info``'s rows) under ``info.key``. A key already
        indexed elsewhere keeps its page; this one stays unindexed (freed on release)."""
        self._check_id(page)
        if self.refs[page] <= 0:
            raise ValueError(f"page {page} must be held to be published")
        if info.key in self.page_of:
            return
        if self.info[page] is not None:
            self._unindex(page)
        self.info[page] = info
        self.page_of[info.key] = page

    def forget(self, key: str) -> bool:
        """Drop ``key`` from the index (e.g. its entry was deleted); an unreferenced page becomes free.
        A referenced page keeps its rows for its holders and is freed on its last release."""
        page = self.page_of.get(key)
        if page is None:
            return False
        self._unindex(page)
        if self.refs[page] == 0:
            self.cached.pop(page, None)
            heapq.heappush(self.free, page)
        return True

    def clear(self) -> None:
        """Forget every key; pages without references become free."""
        for key in list(self.page_of):
            self.forget(key)

    # -- checks --------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the states disagree (used by the tests)."""
        free = set(self.free)
        assert len(free) == len(self.free), "a page is twice in the free heap"
        for page in range(self.num_pages):
            fresh = page >= self.next_fresh
            states = [self.refs[page] > 0, page in self.cached, page in free, fresh]
            assert sum(states) == 1, f"page {page} is in {states} (held, cached, free, fresh)"
            if page in self.cached:
                assert self.info[page] is not None, f"cached page {page} has no key"
            if page in free or fresh:
                assert self.info[page] is None, f"free page {page} is indexed"
        for key, page in self.page_of.items():
            info = self.info[page]
            assert info is not None and info.key == key, f"index of {key[:12]} is stale"

    def _unindex(self, page: int) -> None:
        info = self.info[page]
        if info is not None:
            self.page_of.pop(info.key, None)
            self.info[page] = None

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page id {page} outside [0, {self.num_pages})")


class PageLease:
    """References to pages from a plan until its load: the pages cannot be evicted meanwhile. Released
    once (:meth:`release`, or when the lease is garbage-collected)."""

    def __init__(self, table: PageTable, pages: list[int]) -> None:
        self.pages = list(pages)
        table.acquire(self.pages)
        self._finalizer = weakref.finalize(self, table.release, list(reversed(self.pages)))

    def release(self) -> None:
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive


def page_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive page ids: (first page, its index in ``pages``, length)."""
    runs: list[tuple[int, int, int]] = []
    for index, page in enumerate(pages):
        if runs and runs[-1][0] + runs[-1][2] == page:
            first, at, length = runs[-1]
            runs[-1] = (first, at, length + 1)
        else:
            runs.append((page, index, 1))
    return runs


class PagePool:
    """The pages' tensors on one device and the bulk copies between them and live caches.

    Buffers per layer: ``k_pre`` [kvh, P*B, d] in the KV dtype, ``k_rot`` and ``v`` [kvh, P*B, d] in the
    compute dtype (P pages of B rows), allocated on the first write.
    """

    def __init__(self, layout: PageLayout, num_pages: int) -> None:
        self.layout = layout
        self.table = PageTable(num_pages)
        self.k_pre: list[Tensor] = []
        self.k_rot: list[Tensor] = []
        self.v: list[Tensor] = []

    @classmethod
    def within(cls, layout: PageLayout, budget_bytes: int) -> PagePool:
        """A pool of as many pages as fit in ``budget_bytes``."""
        return cls(layout, layout.within(budget_bytes))

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_pages(self) -> int:
        return self.table.num_pages

    def nbytes(self) -> int:
        """Bytes the pool's buffers take now (0 before the first write)."""
        return self.num_pages * self.layout.page_bytes if self.k_pre else 0

    def fits(self, cache: KVCache) -> bool:
        """Whether ``cache``'s rows have this pool's layout."""
        return PageLayout.of_cache(cache, self.block_size) == self.layout

    def lease(self, pages: list[int]) -> PageLease:
        return PageLease(self.table, pages)

    # -- copies --------------------------------------------------------------------------------------
    def write(self, pages: Sequence[int], cache: KVCache, first_row: int) -> None:
        """Copy the cache's rows ``first_row + i*B ...`` (B rows each) into page ``pages[i]``."""
        self._allocate()
        size = self.block_size
        if first_row + len(pages) * size > cache.length:
            raise ValueError("write: the cache does not hold every row of the pages")
        runs = page_runs(pages)
        pool_index = self._row_index(pages, len(pages) * size) if len(runs) > MANY_RUNS else None
        for layer in range(self.layout.num_layers):
            for pool_bufs, cache_buf in zip(
                (self.k_pre, self.k_rot, self.v), (cache.k_pre, cache.k_rot, cache.v), strict=True
            ):
                src = cache_buf[layer][:, first_row : first_row + len(pages) * size]
                if pool_index is not None:
                    pool_bufs[layer].index_copy_(1, pool_index, src)
                    continue
                for page, at, length in runs:
                    pool_bufs[layer][:, page * size : (page + length) * size] = src[
                        :, at * size : (at + length) * size
                    ]

    def read(self, pages: Sequence[int], cache: KVCache, count: int) -> int:
        """Append ``count`` rows (at most ``len(pages) * B``) holding the pages' first rows to an empty
        ``cache``: the pages are a prefix, their rows sit at positions ``0 .. count - 1``. One copy per
        layer and buffer for each run of consecutive pages (one gather beyond :data:`MANY_RUNS` runs).
        Returns the first appended row (0)."""
        size = self.block_size
        if cache.length:
            raise ValueError("read: pooled pages are a prefix; the cache must be empty")
        if count > len(pages) * size or count < 0:
            raise ValueError(f"read: {count} rows asked of {len(pages)} pages of {size}")
        if not self.k_pre and count:
            raise ValueError("read: the pool holds no pages yet")
        positions = torch.arange(count, device=cache.device)
        token_ids = [t for page in pages for t in self._info(page).token_ids][:count]
        start = cache.append_rows(positions, token_ids)
        runs = page_runs(pages)
        pool_index = self._row_index(pages, count) if len(runs) > MANY_RUNS else None
        for layer in range(self.layout.num_layers):
            for pool_bufs, cache_buf in zip(
                (self.k_pre, self.k_rot, self.v), (cache.k_pre, cache.k_rot, cache.v), strict=True
            ):
                dst = cache_buf[layer][:, start : start + count]
                if pool_index is not None:
                    dst.copy_(pool_bufs[layer].index_select(1, pool_index))
                    continue
                for page, at, length in runs:
                    first = at * size
                    if first >= count:
                        break
                    last = min((at + length) * size, count)
                    dst[:, first:last] = pool_bufs[layer][:, page * size : page * size + last - first]
        return start

    def page_info(self, page: int) -> PageInfo:
        return self._info(page)

    def _info(self, page: int) -> PageInfo:
        info = self.table.info[page]
        if info is None:
            raise ValueError(f"page {page} holds no published block")
        return info

    def _row_index(self, pages: Sequence[int], count: int) -> Tensor:
        """Pool rows [count] of the first ``count`` rows of ``pages``."""
        size = self.block_size
        device = self.layout.device
        page_ids = torch.tensor(list(pages), dtype=torch.long, device=device)
        offsets = torch.arange(size, device=device)
        return (page_ids[:, None] * size + offsets[None, :]).reshape(-1)[:count]

    def _allocate(self) -> None:
        if self.k_pre:
            return
        lay = self.layout
        shape = (lay.num_kv_heads, self.num_pages * lay.block_size, lay.head_dim)
        for _ in range(lay.num_layers):
            self.k_pre.append(torch.empty(shape, dtype=lay.kv_dtype, device=lay.device))
            self.k_rot.append(torch.empty(shape, dtype=lay.compute_dtype, device=lay.device))
            self.v.append(torch.empty(shape, dtype=lay.compute_dtype, device=lay.device))
        log.info(
            "page pool: %d pages of %d tokens (%.0f MiB) on %s",
            self.num_pages,
            lay.block_size,
            self.nbytes() / 2**20,
            lay.device,
        )
