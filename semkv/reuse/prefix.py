"""Exact prefix reuse over chained blocks (the vLLM / SGLang baseline).

The prompt's full blocks are keyed by a chain hash; the longest run of stored
blocks from the start is loaded into the cache and only the rest is prefilled. The
hot tier is the runtime's page pool (:mod:`semkv.models.page_pool`): blocks kept
there are copied in bulk, as they are; the store's tiers (memory, disk, Redis) are
looked up for the blocks after them. A
fully cached prompt still computes its last token (its logits are needed), so at
most ``len(prompt) - 1`` tokens are reused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.page_pool import PageInfo, PageLease, PagePool
from semkv.models.staging import RowSource
from semkv.prompt import PromptLayout
from semkv.reuse.base import (
    BlockSummaries,
    LoadedRows,
    Plan,
    PrefillContext,
    PrefillOutcome,
    Refusal,
    load_then_prefill,
)
from semkv.reuse.options import ReuseOptions
from semkv.store.entry import KVEntry
from semkv.store.keys import (
    PREFIX_DIGEST_META,
    EntryKey,
    EntryKind,
    Namespace,
    prefix_block_keys,
    prefix_digests,
)
from semkv.store.store import KVStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixKeys:
    """A prompt's prefix block keys and digests in one namespace, computed once per request and carried
    from admission to store (:meth:`of_layout` keeps them with the prompt's layout)."""

    keys: tuple[EntryKey, ...]
    digests: tuple[str, ...]

    @classmethod
    def of(
        cls, fingerprint: str, block_size: int, token_ids: Sequence[int], namespace: Namespace | None = None
    ) -> PrefixKeys:
        return cls(
            tuple(prefix_block_keys(fingerprint, block_size, token_ids, namespace)),
            tuple(prefix_digests(fingerprint, block_size, token_ids, namespace)),
        )

    def first(self, count: int) -> PrefixKeys:
        """The keys of the first ``count`` blocks (a prefix of a prompt has its first keys)."""
        return PrefixKeys(self.keys[:count], self.digests[:count])

    @classmethod
    def of_layout(
        cls, fingerprint: str, block_size: int, layout: PromptLayout, namespace: Namespace | None
    ) -> PrefixKeys:
        """The keys of ``layout``'s tokens, computed on the first call and kept in the layout."""
        memo = ("prefix_keys", fingerprint, block_size, namespace)
        found = layout.derived.get(memo)
        if not isinstance(found, PrefixKeys):
            found = cls.of(fingerprint, block_size, layout.token_ids, namespace)
            layout.derived[memo] = found
        return found


@dataclass
class StoredPrefix:
    """The longest stored exact prefix of a prompt: its leading blocks held as pages of the runtime's
    page pool (``lease``, referenced until loaded), then the following blocks found in the store's
    tiers (``blocks``)."""

    lease: PageLease | None
    blocks: list[KVEntry]
    block_size: int

    @property
    def pooled_blocks(self) -> int:
        return 0 if self.lease is None else len(self.lease.pages)

    @property
    def num_blocks(self) -> int:
        return self.pooled_blocks + len(self.blocks)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def release(self) -> None:
        """Drop the pages' references (after loading them, or when the plan is not taken)."""
        if self.lease is not None:
            self.lease.release()


@dataclass
class PrefixPlan(Plan):
    prefix: StoredPrefix

    @property
    def blocks(self) -> list[KVEntry]:
        """The prefix blocks found in the store's tiers (after the pooled ones)."""
        return self.prefix.blocks


def lookup_prefix(
    store: KVStore,
    block_size: int,
    token_ids: list[int],
    namespace: Namespace | None = None,
    *,
    keys: PrefixKeys | None = None,
    first_block: int = 0,
) -> list[KVEntry]:
    """The longest run of ``namespace``'s stored blocks covering ``token_ids`` from block
    ``first_block`` on (0: from the start). ``keys``: the prompt's keys if already computed."""
    if keys is None:
        keys = PrefixKeys.of(store.fingerprint, block_size, token_ids, namespace)
    found: list[KVEntry] = []
    for index in range(first_block, len(keys.keys)):
        expect = token_ids[index * block_size : (index + 1) * block_size]
        entry = store.get(
            keys.keys[index],
            expect,
            EntryKind.BLOCK,
            expect_meta={PREFIX_DIGEST_META: keys.digests[index]},
            chain=False,
        )
        if entry is None or entry.block_size != block_size:
            break
        found.append(entry)
    if found:
        store.touch_chain(list(keys.keys[: first_block + len(found)]))  # once, leaf first
    return found


def find_prefix(
    ctx: PrefillContext, token_ids: list[int], keys: PrefixKeys, namespace: Namespace | None
) -> StoredPrefix:
    """The prompt's longest exact stored prefix: pages of the runtime's page pool from the first block
    on, then blocks of the store's tiers. The pages are leased (not evictable) until
    :meth:`StoredPrefix.release`."""
    pool = ctx.runtime.page_pool
    lease = None
    if pool is not None:
        pages = pool.table.lookup_chain(keys.keys, token_ids, keys.digests, ctx.block_size)
        if pages:
            lease = pool.lease(pages)
            pool.table.touch(list(reversed(pages)))
    first = 0 if lease is None else len(lease.pages)
    blocks = lookup_prefix(ctx.store, ctx.block_size, token_ids, namespace, keys=keys, first_block=first)
    return StoredPrefix(lease, blocks, ctx.block_size)


SUMMARY_EXTRA = "summary."  # prefix of a stored block's extras that hold its summaries


def summary_extras(summaries: BlockSummaries | None, block: int) -> dict[str, Tensor]:
    """The extras that store block ``block``'s summaries with it ({} if it has none)."""
    if summaries is None or block >= summaries.num_complete:
        return {}
    return {SUMMARY_EXTRA + kind: t for kind, t in summaries.block_summaries(block).items()}


def stored_summaries(blocks: list[KVEntry], num_tokens: int, block_size: int) -> list[dict[str, Tensor]]:
    """The summaries carried by the leading blocks whose rows are all loaded (up to the first without)."""
    out = []
    for block in blocks[: num_tokens // block_size]:
        found = {k[len(SUMMARY_EXTRA) :]: t for k, t in block.extras.items() if k.startswith(SUMMARY_EXTRA)}
        if not found:
            break
        out.append(found)
    return out


def load_prefix(
    ctx: PrefillContext,
    cache: KVCache,
    blocks: list[KVEntry],
    num_tokens: int,
    first_position: int = 0,
) -> list[dict[str, Tensor]]:
    """Append the first ``num_tokens`` tokens of ``blocks`` (store entries) to ``cache`` at positions
    ``first_position ..`` (where the blocks sit in the prompt); returns the summaries the fully loaded
    blocks carry (see :func:`stored_summaries`)."""
    if num_tokens <= 0:
        return []
    pieces: list[RowSource] = []
    left = num_tokens
    for block in blocks:  # each block a piece: the loader stages them in bulk (no joined copy of them all)
        take = min(left, block.k.shape[2])
        if take <= 0:
            break
        pieces.append(RowSource(block.k[:, :, :take], block.v[:, :, :take]))
        left -= take
    token_ids = [t for b in blocks for t in b.token_ids][:num_tokens]
    ctx.runtime.load_pieces(cache, pieces, ctx.runtime.positions(first_position, num_tokens), token_ids)
    return stored_summaries(blocks, num_tokens, ctx.block_size)


def pooled_summaries(pool: PagePool, pages: list[int], num_tokens: int) -> list[dict[str, Tensor]]:
    """The summaries kept with the leading pages whose rows are all loaded (up to the first without)."""
    out = []
    for page in pages[: num_tokens // pool.block_size]:
        extras = pool.page_info(page).extras
        if not extras:
            break
        out.append(dict(extras))
    return out


def load_stored_prefix(
    ctx: PrefillContext, cache: KVCache, prefix: StoredPrefix, num_tokens: int, share: bool = False
) -> list[dict[str, Tensor]]:
    """Append the prefix's first ``num_tokens`` rows to the empty ``cache``: the pooled pages' rows in
    bulk (:meth:`PagePool.read`: plain copies, the rows are in the cache's own format), then the store
    blocks' rows (re-rotated from their pre-RoPE keys). ``share``, when the pool holds the whole
    prefix: the cache reads it shared with every other live cache that starts with it
    (:meth:`PagePool.shared_prefix`; no copy of its own); a path that rewrites rows leaves it off.
    Releases the pages' lease. Returns the summaries of the leading fully loaded blocks."""
    pool = ctx.runtime.page_pool
    pooled = min(num_tokens, prefix.pooled_blocks * ctx.block_size)
    summaries: list[dict[str, Tensor]] = []
    try:
        if pooled and pool is not None and prefix.lease is not None:
            if share and pooled == num_tokens and not cache.length and pool.fits(cache):
                shared, readable = pool.shared_prefix(prefix.lease.pages, pooled)
                cache.share_prefix(shared, readable)
                pool.read(prefix.lease.pages, cache, pooled, skip=readable)
            else:
                pool.read(prefix.lease.pages, cache, pooled)
            summaries = pooled_summaries(pool, prefix.lease.pages, pooled)
    finally:
        prefix.release()
    rest = num_tokens - pooled
    if rest > 0:
        with ctx.store.pinned([b.key for b in prefix.blocks]):
            stored = load_prefix(ctx, cache, prefix.blocks, rest, first_position=pooled)
        if len(summaries) * ctx.block_size == pooled:  # summaries only while they run unbroken
            summaries += stored
    return summaries


def publish_prefix(
    pool: PagePool,
    cache: KVCache,
    token_ids: Sequence[int],
    keys: PrefixKeys,
    summaries: BlockSummaries | None = None,
    num_blocks: int | None = None,
) -> int:
    """Keep the cache's first ``num_blocks`` full blocks (all by default; exact KV at positions 0..) as
    pages of ``pool``, those it does not hold yet: pages are taken (evicting the least recently used),
    filled in bulk, indexed under the blocks' keys and left cached. The chain is then touched leaf first.
    Returns pages written (0 when the pool has no room: every page is referred to)."""
    size = pool.block_size
    count = len(keys.keys) if num_blocks is None else min(num_blocks, len(keys.keys))
    count = min(count, cache.length // size)
    if count <= 0 or not pool.fits(cache):
        return 0
    table = pool.table
    present = [page for page in (table.lookup(k) for k in keys.keys[:count]) if page is not None]
    table.acquire(present)  # the chain's own pages are not evicted to make room for the rest
    try:
        missing = [i for i in range(count) if table.lookup(keys.keys[i]) is None]
        room = table.available()
        if len(missing) > room:  # keep the leading blocks that fit: a prefix is hit from its root
            log.info("page pool: %d of the prompt's %d missing blocks fit", room, len(missing))
            missing = missing[:room]
        if missing:
            _publish_blocks(pool, cache, token_ids, keys, summaries, missing)
    finally:
        table.release(list(reversed(present)))
    chain = [table.lookup(keys.keys[i]) for i in range(count)]
    table.touch([page for page in reversed(chain) if page is not None])
    return len(missing)


def _publish_blocks(
    pool: PagePool,
    cache: KVCache,
    token_ids: Sequence[int],
    keys: PrefixKeys,
    summaries: BlockSummaries | None,
    missing: list[int],
) -> None:
    """Take pages for the blocks ``missing`` (at most :meth:`PageTable.available`), fill them from the
    cache in bulk, index them under the blocks' keys and release them (cached, evictable)."""
    size, table = pool.block_size, pool.table
    pages = table.allocate(len(missing))
    page_of_block = dict(zip(missing, pages, strict=True))
    try:
        for run in _block_runs(missing):
            pool.write([page_of_block[i] for i in run], cache, run[0] * size)
        for index in missing:
            extras = {
                kind.removeprefix(SUMMARY_EXTRA): t for kind, t in summary_extras(summaries, index).items()
            }
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            table.publish(
                page_of_block[index], PageInfo(keys.keys[index], tokens, keys.digests[index], extras)
            )
    finally:  # a failed write leaves its pages unindexed: released, they are free again
        table.release([page_of_block[i] for i in reversed(missing)])


def _block_runs(blocks: list[int]) -> list[list[int]]:
    """Consecutive block indices grouped (their rows are one piece of the cache)."""
    runs: list[list[int]] = []
    for index in blocks:
        if runs and runs[-1][-1] + 1 == index:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def store_prefix(
    ctx: PrefillContext,
    cache: KVCache,
    token_ids: list[int],
    skip_blocks: int = 0,
    summaries: BlockSummaries | None = None,
    namespace: Namespace | None = None,
    keys: PrefixKeys | None = None,
) -> int:
    """Store every full block of the cache's first ``len(token_ids)`` rows from block ``skip_blocks`` on,
    under ``namespace``'s keys (``keys`` if already computed), each with its summaries from
    ``summaries`` when it has them (so a later hit does not recompute them).

    The rows must hold exact (full-prefill-equivalent) KV at positions 0... Returns blocks written.
    The rows of the blocks to write are exported in one piece (one cast per layer, not one per layer and
    block, several times cheaper) and copied out per block.
    """
    size = ctx.block_size
    if keys is None:
        keys = PrefixKeys.of(ctx.fingerprint, size, token_ids, namespace)
    # not contains(): re-publish to a tier that lost it
    missing = [i for i in range(skip_blocks, len(keys.keys)) if not ctx.store.held_by_all(keys.keys[i])]
    if not missing:
        return 0
    first = missing[0] * size
    k_rows, v_rows = cache.export(first, (missing[-1] + 1) * size)  # [L, kvh, rows, d] each
    written = 0
    for index in missing:
        rows = slice(index * size - first, (index + 1) * size - first)
        k, v = k_rows[:, :, rows].contiguous(), v_rows[:, :, rows].contiguous()
        parent = keys.keys[index - 1] if index else None
        ctx.store.put(
            KVEntry(
                keys.keys[index],
                EntryKind.BLOCK,
                ctx.fingerprint,
                token_ids[index * size : (index + 1) * size],
                k,
                v,
                block_size=size,
                parent=parent,
                extras=summary_extras(summaries, index),
                meta={PREFIX_DIGEST_META: keys.digests[index]},
            ),
            chain=False,
        )
        written += 1
    ctx.store.touch_chain(list(keys.keys[: missing[-1] + 1]))  # once, leaf first: linear in the chain
    return written


class PrefixReuse:
    """Exact prefix reuse: the page pool's pages first (a copy of rows already in the cache's format),
    then the store's blocks."""

    name = "prefix"

    def plan(self, ctx: PrefillContext, options: ReuseOptions, layout: PromptLayout) -> PrefixPlan | Refusal:
        token_ids = layout.token_ids
        keys = PrefixKeys.of_layout(ctx.fingerprint, ctx.block_size, layout, options.namespace)
        prefix = find_prefix(ctx, token_ids, keys, options.namespace)
        reused = min(prefix.num_tokens, len(token_ids) - 1)
        if reused <= 0:
            prefix.release()
            return Refusal(self.name, "no stored prefix block")
        return PrefixPlan(self.name, layout, reused, prefix)

    def load(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> LoadedRows:
        """The stored prefix's rows (the plan's ``reused_tokens``) and the summaries they carry."""
        assert isinstance(plan, PrefixPlan)
        summaries = load_stored_prefix(ctx, cache, plan.prefix, plan.reused_tokens, share=True)
        info = {"prefix_blocks": plan.prefix.num_blocks, "pooled_blocks": plan.prefix.pooled_blocks}
        return LoadedRows(info, summaries)

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome:
        return load_then_prefill(self, ctx, plan, cache)

    def after_prefill(
        self,
        ctx: PrefillContext,
        options: ReuseOptions,
        layout: PromptLayout,
        cache: KVCache,
        outcome: PrefillOutcome,
    ) -> None:
        """Keep an exact prefill's full blocks (any path whose outcome is exact) as pages of the page pool
        and as prefix blocks of the store."""
        if not outcome.exact:
            return
        keys = PrefixKeys.of_layout(ctx.fingerprint, ctx.block_size, layout, options.namespace)
        pool = ctx.runtime.page_pool
        if pool is not None:
            publish_prefix(pool, cache, layout.token_ids, keys, outcome.summaries)
        store_prefix(
            ctx,
            cache,
            layout.token_ids,
            summaries=outcome.summaries,
            namespace=options.namespace,
            keys=keys,
        )
