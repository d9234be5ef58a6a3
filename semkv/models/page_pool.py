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

Running sequences that hit the same pooled prefix share its rows: :meth:`PagePool.shared_prefix` makes
one :class:`~semkv.models.cache.SharedPrefix` of the pages (views of the pool's buffers when the pages are
consecutive, else one gather) that every cache starting with those pages reads while it lives (kept
weakly under the key of every whole page it holds). A cache that must change a prefix row copies the
prefix in first (copy-on-write of the whole prefix), and a cache left alone with it copies it in before
decoding (one piece of attention is faster than two; docs/design.md).
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

from semkv.models.cache import KeyRows, KVCache, SharedPrefix, row_bytes

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


def take_rows(buffer: Tensor, rows: slice | Tensor) -> Tensor:
    """Rows ``rows`` of a pool buffer [kvh, P*B, d]: a view for a range, a gathered copy for an index."""
    if isinstance(rows, slice):
        return buffer[:, rows]
    return buffer.index_select(1, rows)


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
        # prefixes gathered from pages and read by live caches, under the key of every whole page they hold
        self.shared: weakref.WeakValueDictionary[str, SharedPrefix] = weakref.WeakValueDictionary()

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
        rows = slice(first_row, first_row + len(pages) * size)
        for layer in range(self.layout.num_layers):
            for pool_bufs, src in zip(
                (self.k_pre, self.k_rot, self.v), cache.row_buffers(layer, rows), strict=True
            ):
                if pool_index is not None:
                    pool_bufs[layer].index_copy_(1, pool_index, src)
                    continue
                for page, at, length in runs:
                    pool_bufs[layer][:, page * size : (page + length) * size] = src[
                        :, at * size : (at + length) * size
                    ]

    def read(self, pages: Sequence[int], cache: KVCache, count: int, skip: int = 0) -> int:
        """Append rows ``skip .. count - 1`` of the pages (``count`` at most ``len(pages) * B``) to a
        ``cache`` holding ``skip`` rows (the pages' first ones, e.g. read from a shared prefix): the pages
        are a prefix, their rows sit at positions ``0 .. count - 1``. One copy per layer and buffer for each
        run of consecutive pages (one gather beyond :data:`MANY_RUNS` runs, or when ``skip`` is not 0).
        Returns the first appended row (``skip``)."""
        size = self.block_size
        if cache.length != skip:
            raise ValueError(f"read: pooled pages are a prefix; the cache must hold {skip} rows")
        if count > len(pages) * size or not 0 <= skip <= count:
            raise ValueError(f"read: rows {skip}..{count} asked of {len(pages)} pages of {size}")
        if not self.k_pre and count:
            raise ValueError("read: the pool holds no pages yet")
        if skip == count:
            return skip
        positions = torch.arange(skip, count, device=cache.device)
        token_ids = [t for page in pages for t in self._info(page).token_ids][skip:count]
        start = cache.append_rows(positions, token_ids)
        runs = page_runs(pages)
        pool_index = self._row_index(pages, count)[skip:] if len(runs) > MANY_RUNS or skip else None
        count -= skip
        rows = slice(start, start + count)
        for layer in range(self.layout.num_layers):
            for pool_bufs, dst in zip(
                (self.k_pre, self.k_rot, self.v), cache.row_buffers(layer, rows), strict=True
            ):
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

    def shared_prefix(self, pages: Sequence[int], count: int) -> tuple[SharedPrefix, int]:
        """A :class:`SharedPrefix` holding the first rows of ``pages`` (a prefix: positions 0 ..
        ``count`` - 1) and how many of them (from the first) a cache may read from it: the live prefix
        that holds the longest run of these pages, if one does (it may hold other rows after them, and
        fewer than ``count``: the caller reads the rest from the pages), else a new prefix of ``count``
        rows: views of the pool's buffers when the pages are consecutive (no copy), else gathered (one
        ``index_select`` per layer of the rotated keys and values). A prefix holds a lease on its pages
        while it lives (they are neither evicted nor handed out, so the views stay its rows) and reads its
        pre-RoPE keys from them when asked."""
        size = self.block_size
        if not 0 < count <= len(pages) * size:
            raise ValueError(f"shared_prefix: {count} rows asked of {len(pages)} pages of {size}")
        if not self.k_pre:
            raise ValueError("shared_prefix: the pool holds no pages yet")
        used = list(pages[: -(-count // size)])
        token_ids = [t for page in used for t in self._info(page).token_ids][:count]
        for whole in range(count // size, 0, -1):  # the longest run of whole pages a live prefix holds
            found = self.shared.get(self._info(used[whole - 1]).key)
            if found is not None:
                readable = whole * size
                end = min(found.rows, count)
                if found.token_ids[readable:end] == tuple(token_ids[readable:end]):
                    readable = max(readable, end)  # the same tokens after the pages: the same rows
                return found, readable
        rows = self._pool_rows(used, count)
        k_rot = [take_rows(buf, rows) for buf in self.k_rot]
        v = [take_rows(buf, rows) for buf in self.v]
        prefix = SharedPrefix(
            k_rot, v, token_ids, self._key_reader(rows), self.layout.kv_dtype, keep=self.lease(used)
        )
        for page in used[: count // size]:
            self.shared[self._info(page).key] = prefix
        return prefix, count

    def _key_reader(self, rows: slice | Tensor) -> KeyRows:
        """Pre-RoPE keys of the pool rows ``rows`` (a range, or an index [count]), read per layer and row
        range (views of the pool when ``rows`` is a range)."""
        buffers = self.k_pre

        def read(layer: int, start: int, end: int) -> Tensor:
            part = slice(rows.start + start, rows.start + end) if isinstance(rows, slice) else rows[start:end]
            return take_rows(buffers[layer], part)

        return read

    def _pool_rows(self, pages: Sequence[int], count: int) -> slice | Tensor:
        """Where the first ``count`` rows of ``pages`` lie in the pool's buffers: one range when the pages
        are consecutive, else an index [count]."""
        runs = page_runs(pages)
        if len(runs) == 1:
            first = runs[0][0] * self.block_size
            return slice(first, first + count)
        return self._row_index(pages, count)

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
