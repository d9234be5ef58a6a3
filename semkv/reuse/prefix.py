"""Exact prefix reuse over chained blocks (the vLLM / SGLang baseline).

The prompt's full blocks are keyed by a chain hash; the longest run of stored
blocks from the start is loaded into the cache and only the rest is prefilled. A
fully cached prompt still computes its last token (its logits are needed), so at
most ``len(prompt) - 1`` tokens are reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from semkv.models.cache import KVCache
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
from semkv.store.keys import PREFIX_DIGEST_META, EntryKind, Namespace, prefix_block_keys, prefix_digests
from semkv.store.store import KVStore


@dataclass
class PrefixPlan(Plan):
    blocks: list[KVEntry]


def lookup_prefix(
    store: KVStore, block_size: int, token_ids: list[int], namespace: Namespace | None = None
) -> list[KVEntry]:
    """The longest run of ``namespace``'s stored blocks covering ``token_ids`` from the start."""
    found: list[KVEntry] = []
    digests = prefix_digests(store.fingerprint, block_size, token_ids, namespace)
    for index, key in enumerate(prefix_block_keys(store.fingerprint, block_size, token_ids, namespace)):
        expect = token_ids[index * block_size : (index + 1) * block_size]
        entry = store.get(
            key, expect, EntryKind.BLOCK, expect_meta={PREFIX_DIGEST_META: digests[index]}, chain=False
        )
        if entry is None or entry.block_size != block_size:
            break
        found.append(entry)
    store.touch_chain([entry.key for entry in found])  # once, leaf first: linear in the chain
    return found


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
    ctx: PrefillContext, cache: KVCache, blocks: list[KVEntry], num_tokens: int
) -> list[dict[str, Tensor]]:
    """Load the first ``num_tokens`` tokens of ``blocks`` into ``cache`` at positions 0..; returns the
    summaries the fully loaded blocks carry (see :func:`stored_summaries`)."""
    k = torch.cat([b.k for b in blocks], dim=2)[:, :, :num_tokens]
    v = torch.cat([b.v for b in blocks], dim=2)[:, :, :num_tokens]
    token_ids = [t for b in blocks for t in b.token_ids][:num_tokens]
    ctx.runtime.load_rows(cache, k, v, ctx.runtime.positions(0, num_tokens), token_ids)
    return stored_summaries(blocks, num_tokens, ctx.block_size)


def store_prefix(
    ctx: PrefillContext,
    cache: KVCache,
    token_ids: list[int],
    skip_blocks: int = 0,
    summaries: BlockSummaries | None = None,
    namespace: Namespace | None = None,
) -> int:
    """Store every full block of the cache's first ``len(token_ids)`` rows from block ``skip_blocks`` on,
    under ``namespace``'s keys, each with its summaries from ``summaries`` when it has them (so a later
    hit does not recompute them).

    The rows must hold exact (full-prefill-equivalent) KV at positions 0... Returns blocks written.
    The rows of the blocks to write are exported in one piece (one cast per layer, not one per layer and
    block, several times cheaper) and copied out per block.
    """
    size = ctx.block_size
    keys = prefix_block_keys(ctx.fingerprint, size, token_ids, namespace)
    digests = prefix_digests(ctx.fingerprint, size, token_ids, namespace)
    # not contains(): re-publish to a tier that lost it
    missing = [i for i in range(skip_blocks, len(keys)) if not ctx.store.held_by_all(keys[i])]
    if not missing:
        return 0
    first = missing[0] * size
    k_rows, v_rows = cache.export(first, (missing[-1] + 1) * size)  # [L, kvh, rows, d] each
    written = 0
    for index in missing:
        rows = slice(index * size - first, (index + 1) * size - first)
        k, v = k_rows[:, :, rows].contiguous(), v_rows[:, :, rows].contiguous()
        parent = keys[index - 1] if index else None
        ctx.store.put(
            KVEntry(
                keys[index],
                EntryKind.BLOCK,
                ctx.fingerprint,
                token_ids[index * size : (index + 1) * size],
                k,
                v,
                block_size=size,
                parent=parent,
                extras=summary_extras(summaries, index),
                meta={PREFIX_DIGEST_META: digests[index]},
            ),
            chain=False,
        )
        written += 1
    ctx.store.touch_chain(keys[: missing[-1] + 1])  # once, leaf first: linear in the chain
    return written


class PrefixReuse:
    name = "prefix"

    def plan(self, ctx: PrefillContext, options: ReuseOptions, layout: PromptLayout) -> PrefixPlan | Refusal:
        token_ids = layout.token_ids
        blocks = lookup_prefix(ctx.store, ctx.block_size, token_ids, options.namespace)
        reused = min(len(blocks) * ctx.block_size, len(token_ids) - 1)
        if reused <= 0:
            return Refusal(self.name, "no stored prefix block")
        return PrefixPlan(self.name, layout, reused, blocks)

    def load(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> LoadedRows:
        """The stored prefix blocks' rows (the plan's ``reused_tokens``) and the summaries they carry."""
        assert isinstance(plan, PrefixPlan)
        with ctx.store.pinned([b.key for b in plan.blocks]):
            summaries = load_prefix(ctx, cache, plan.blocks, plan.reused_tokens)
        return LoadedRows({"prefix_blocks": len(plan.blocks)}, summaries)

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
        """Store an exact prefill's full blocks as prefix blocks (any path whose outcome is exact)."""
        if outcome.exact:
            store_prefix(
                ctx, cache, layout.token_ids, summaries=outcome.summaries, namespace=options.namespace
            )
