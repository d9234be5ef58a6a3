"""CacheBlend: reuse precomputed document (chunk) KV at any position, with selective recompute.

Chunk precompute
    A chunk's KV is computed once, on its own, and stored as a position-independent
    :data:`EntryKind.CHUNK` entry under ``chunk_key(fingerprint, token_ids)`` (no parent):
    pre-RoPE keys and values [L, kvh, n, d] of its tokens at local positions.

    Namespaces. Chunk keys are scoped by the request's namespace (tenant + cache salt); a chunk is
    looked up in the request's namespace first, then in the shared namespace (documents published to
    every tenant), and chunks computed for a request are stored in its own namespace only.

    Attention sink. A chunk computed alone makes its own first token the attention
    sink: every later token of the chunk dumps attention mass there, and in the blended
    prompt (where the real sink is the template's first token) those rows are wrong. So
    by default (``sink="bos"``) a chunk is computed after the BOS token (SmolLM2:
    ``<|im_start|>``), whose KV is then dropped; ``"template"`` computes it after the
    model's default chat-template prefix (system turn + user header); ``"none"`` alone.
    ``"bos"`` is the default: it gave the lowest first-token KL to full prefill at ratio 0
    (``docs/benchmarks.md``). The sink tokens' digest is kept in the
    entry's metadata and checked on every hit: a chunk made with another sink is a miss
    (and is replaced when recomputed).

    What a chunk should be. A chunk is computed without the text before it, so it should be a text that
    stands alone: a document, or a retrieved passage. A document cut into consecutive chunks (one per
    paragraph) loses, in every piece, what it read of the pieces before it (a name a later "it" refers
    to), and recomputing a share of the rows does not give that back: cache such a document as one chunk
    (``docs/benchmarks.md``, "Is it the chunking?").

Prefill (the blend)
    1. the longest exact prefix hit (``reuse/prefix.py``) is loaded as exact prefix reuse,
       never blended (it usually covers the template, sometimes the first chunk(s));
    2. each stored chunk's KV is loaded at its new positions (:meth:`Runtime.load_pieces`
       re-applies RoPE to the stored pre-RoPE keys: exact);
    3. the uncached rows (template rest, body, suffix, chunks not stored) are appended and always
       recomputed (``forced``). A chunk is stored with the separator that follows it in every prompt
       (``BlendConfig.separator_in_chunk``, the default), so the separators are reused rows like the
       chunk's own (the selectors that rank by KV deviation still recompute them); without it they are
       uncached rows too;
    4. :meth:`Runtime.forward_rows` with a :class:`~semkv.reuse.selective.SelectiveRecompute`: layers
       before the check layer recompute every row; at the check layer the best ``recompute_ratio`` of
       the cached rows by the config's row selector (:mod:`semkv.reuse.selection`) go on with the
       forced rows, the rest keep their reused KV. ``deviation`` is CacheBlend's KV deviation;
       ``query`` ranks by the question's attention, measured by a cheap probe pass over the reused KV
       run first (:class:`~semkv.reuse.selective.QueryProbe`); ``chunk-start`` takes every chunk's
       first tokens (EPIC). Optional gradual filtering narrows the set over three layers (2r, 1.5r, r);
       a selector's ``temperature`` / ``scale`` rescale the question rows' attention to the chunks
       (APE-style, :class:`~semkv.reuse.selection.base.ContextScaling`). The probe, and a recompute whose
       rows are known before the forward (check layer 0, a selector that does not use deviation), run
       only their rows from layer 0 on (:func:`~semkv.reuse.selective.forward_fixed_rows`): the same
       logits, without every row's layer-0 projections and the per-layer gathers.

The outcome is never exact (``exact=False``): blended KV is never stored as prefix
blocks. After the first token, the exact rows before the first reused chunk row are
stored as prefix blocks, and chunks that were not stored are precomputed and stored
(a post-prefill hook, so it is not in TTFT).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from semkv.models.cache import KVCache
from semkv.models.runtime import attention
from semkv.models.staging import RowSource
from semkv.prompt import PromptLayout, Segment, build_layout, separator_ids, tokenize_text
from semkv.reuse.base import Plan, PrefillContext, PrefillOutcome, Refusal
from semkv.reuse.options import BlendConfig, ReuseOptions, SinkMode
from semkv.reuse.prefix import (
    PrefixKeys,
    StoredPrefix,
    find_prefix,
    load_stored_prefix,
    publish_prefix,
    store_prefix,
)
from semkv.reuse.selection.base import ContextScaling, RowInfo, RowSelector
from semkv.reuse.selective import QueryProbe, SelectiveRecompute, forward_fixed_rows
from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKey, EntryKind, Namespace, chunk_key

log = logging.getLogger(__name__)

# -- chunks ---------------------------------------------------------------------------------------


def sink_tokens(ctx: PrefillContext, sink: SinkMode) -> list[int]:
    """The tokens a chunk is precomputed after (their KV is dropped)."""
    if sink == "none":
        return []
    if sink == "bos":
        bos = getattr(ctx.tokenizer, "bos_token_id", None)
        return [int(bos)] if bos is not None else []
    layout = build_layout(ctx.tokenizer, prompt="x")
    first = layout.segments[0]
    if first.kind == "template" and first.token_ids:
        return list(first.token_ids)
    bos = getattr(ctx.tokenizer, "bos_token_id", None)
    return [int(bos)] if bos is not None else []


def chunk_tail(ctx: PrefillContext, config: BlendConfig) -> list[int]:
    """The tokens stored after every chunk's own: the separator that follows each chunk in a prompt
    (``config.separator_in_chunk``), else none. Tokenized once per call: callers reuse it for every chunk."""
    return separator_ids(ctx.tokenizer) if config.separator_in_chunk else []


def stored_chunk_ids(chunk_ids: Sequence[int], tail: Sequence[int]) -> list[int]:
    """The tokens a chunk is precomputed and stored as: its own, then ``tail`` (:func:`chunk_tail`); none for
    an empty chunk."""
    return [*chunk_ids, *tail] if chunk_ids else []


def _digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()[:16]


def lookup_chunk(
    ctx: PrefillContext, token_ids: Sequence[int], sink_ids: Sequence[int], namespace: Namespace | None = None
) -> KVEntry | None:
    """``namespace``'s stored chunk for ``token_ids`` made by this model (fingerprint) with these sink
    tokens, or None."""
    entry = ctx.store.get(chunk_key(ctx.fingerprint, token_ids, namespace), token_ids, EntryKind.CHUNK)
    if entry is None:
        return None
    if entry.meta.get("sink_digest") != _digest(sink_ids):
        log.info("stored chunk %s was made with another attention sink; treated as a miss", entry.key[:12])
        return None
    return entry


def find_chunk(
    ctx: PrefillContext, token_ids: Sequence[int], sink_ids: Sequence[int], namespace: Namespace
) -> KVEntry | None:
    """The chunk from ``namespace``, else from the shared namespace (published documents), or None."""
    entry = lookup_chunk(ctx, token_ids, sink_ids, namespace)
    shared = Namespace.shared()
    if entry is None and namespace != shared:
        entry = lookup_chunk(ctx, token_ids, sink_ids, shared)
    return entry


def precompute_chunk(
    ctx: PrefillContext, token_ids: Sequence[int], sink_ids: Sequence[int], namespace: Namespace | None = None
) -> KVEntry:
    """Compute a chunk's KV after ``sink_ids`` (dropped) and return it as a CHUNK entry (not stored).

    Entry k, v: [L, kvh, n, d] pre-RoPE keys / values in the KV dtype.
    """
    ids, sink = [int(t) for t in token_ids], [int(t) for t in sink_ids]
    runtime = ctx.runtime
    cache = runtime.new_cache(len(sink) + len(ids))
    runtime.prefill(cache, sink + ids)
    k, v = cache.export(len(sink), len(sink) + len(ids))
    return KVEntry(
        chunk_key(ctx.fingerprint, ids, namespace),
        EntryKind.CHUNK,
        ctx.fingerprint,
        ids,
        k,
        v,
        meta={"sink_digest": _digest(sink), "sink_tokens": len(sink)},
    )


def store_chunk(ctx: PrefillContext, entry: KVEntry) -> None:
    """Store a chunk entry, replacing one under the same key made with another sink (tiers keep the
    first entry put under a key)."""
    ctx.store.delete(entry.key)
    ctx.store.put(entry)


def add_chunks(
    ctx: PrefillContext,
    texts: Sequence[str],
    config: BlendConfig | None = None,
    namespace: Namespace | None = None,
) -> list[EntryKey]:
    """Precompute and store each text's position-independent KV under ``namespace``; return their keys.

    Every text is validated and tokenized before any compute: a non-string, an empty text
    or one longer than the model's context is a ``ValueError``. Texts already stored are
    not recomputed.
    """
    if isinstance(texts, str):
        raise ValueError("add_chunks takes a list of texts, not one string")
    config = config or BlendConfig()
    sink = sink_tokens(ctx, config.sink)
    limit = int(ctx.runtime.adapter.max_positions)
    tail = chunk_tail(ctx, config)
    tokenized: list[list[int]] = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"chunk {index} must be a str, got {type(text).__name__}")
        ids = stored_chunk_ids(tokenize_text(ctx.tokenizer, text), tail)
        if not ids:
            raise ValueError(f"chunk {index} is empty")
        if len(ids) + len(sink) > limit:
            raise ValueError(
                f"chunk {index} has {len(ids)} tokens (+{len(sink)} sink tokens), more than the model's "
                f"context of {limit}"
            )
        tokenized.append(ids)
    keys = []
    for ids in tqdm(tokenized, desc="precompute chunks", unit="chunk", disable=len(tokenized) < 4):
        if lookup_chunk(ctx, ids, sink, namespace) is None:
            store_chunk(ctx, precompute_chunk(ctx, ids, sink, namespace))
        keys.append(chunk_key(ctx.fingerprint, ids, namespace))
    return keys


# -- the path ---------------------------------------------------------------------------------------


@dataclass
class BlendPlan(Plan):
    """prefix_tokens: rows loaded as exact prefix reuse (from ``prefix``: page-pool pages, then store
    blocks). chunks: per chunk segment of the layout (in order), its stored entry or None (a miss)."""

    config: BlendConfig = field(default_factory=BlendConfig)
    prefix: StoredPrefix | None = None
    prefix_tokens: int = 0
    chunks: list[KVEntry | None] = field(default_factory=list)
    misses: int = 0


class BlendReuse:
    name = "blend"

    def plan(self, ctx: PrefillContext, options: ReuseOptions, layout: PromptLayout) -> BlendPlan | Refusal:
        config = options.blend
        spans = layout.chunk_spans()
        if not any(seg.token_ids for seg, _, _ in spans):
            return Refusal(self.name, "no context chunks")
        token_ids = layout.token_ids
        keys = PrefixKeys.of_layout(ctx.fingerprint, ctx.block_size, layout, options.namespace)
        stored_prefix = find_prefix(ctx, token_ids, keys, options.namespace)
        prefix = min(stored_prefix.num_tokens, len(token_ids) - 1)
        sink = sink_tokens(ctx, config.sink)
        chunks: list[KVEntry | None] = []
        misses = 0
        tail = chunk_tail(ctx, config)
        for seg, start, end in spans:
            ids = stored_chunk_ids(seg.token_ids, tail)
            end = start + len(ids)  # with the separator when it is stored with the chunk
            wanted = bool(ids) and end > prefix
            entry = find_chunk(ctx, ids, sink, options.namespace) if wanted else None
            chunks.append(entry)
            misses += wanted and entry is None
        loaded = sum(
            e - max(s, prefix)
            for seg, s, e, entry, _ in _stored_rows(layout, chunks, config.separator_in_chunk)
            if e > prefix and not _forced(seg, entry, config.selector)
        )
        if loaded == 0 and (options.mode != self.name or misses == 0):
            # Under "auto" a blend without stored chunks reuses nothing; asked for explicitly, the
            # missing chunks are computed in place (exact) and stored after the first token.
            stored_prefix.release()
            return Refusal(self.name, "no stored chunk beyond the exact prefix")
        reused = prefix + int(loaded * (1.0 - config.recompute_ratio))
        return BlendPlan(self.name, layout, reused, config, stored_prefix, max(prefix, 0), chunks, misses)

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome:
        assert isinstance(plan, BlendPlan)
        runtime, layout, config = ctx.runtime, plan.layout, plan.config
        held = [c.key for c in plan.chunks if c is not None]
        forced: list[bool] = []
        query: list[bool] = []
        offsets: list[int] = []
        pieces: list[RowSource] = []  # per segment after the prefix: its rows of a stored entry, or none
        with ctx.store.pinned(held):
            stored = []
            pooled = 0 if plan.prefix is None else plan.prefix.pooled_blocks
            if plan.prefix is not None:  # the pool's pages in bulk, then the store's blocks
                stored = load_stored_prefix(ctx, cache, plan.prefix, plan.prefix_tokens)
            start = cache.length
            for seg, s, e, entry, at in _stored_rows(layout, plan.chunks, config.separator_in_chunk):
                if e <= plan.prefix_tokens:
                    continue
                first = max(s, plan.prefix_tokens)
                lo, hi = at + first - s, at + e - s
                pieces.append(
                    RowSource.empty(hi - lo)
                    if entry is None
                    else RowSource(entry.k[:, :, lo:hi], entry.v[:, :, lo:hi])
                )
                forced.extend([_forced(seg, entry, config.selector)] * (e - first))
                query.extend([seg.kind in ("body", "suffix")] * (e - first))
                reused = seg.kind == "chunk" or entry is not None
                offsets.extend(range(at + first - s, at + e - s) if reused else [-1] * (e - first))
            positions = runtime.positions(plan.prefix_tokens, len(layout) - plan.prefix_tokens)
            runtime.load_pieces(cache, pieces, positions, layout.token_ids[plan.prefix_tokens :])
        rows = RowInfo(
            runtime.index(forced, torch.bool), runtime.index(query, torch.bool), runtime.index(offsets)
        )
        recompute = self._recompute(ctx, config, rows, cache, start)
        keep = recompute.preselect() if cache.query_observer is None else None
        if keep is None:
            logits = runtime.forward_rows(cache, start, recompute)
        else:
            logits = forward_fixed_rows(runtime, cache, start, keep, recompute.attention or attention)
        assert logits is not None
        recomputed_rows = (recompute.recomputed_rows() + start).tolist()
        num_forced = sum(forced)
        blended = len(forced) - num_forced
        recomputed = len(recomputed_rows)
        first_reused = start + next((i for i, f in enumerate(forced) if not f), len(forced))
        hits = sum(c is not None for c in plan.chunks)
        info: dict[str, Any] = {
            "prefix_tokens": plan.prefix_tokens,
            "pooled_blocks": pooled,
            "chunk_hits": hits,
            "chunk_misses": plan.misses,
            "blend_cached_tokens": blended,
            "blend_selected_tokens": recomputed - num_forced,
            "recompute_ratio": config.recompute_ratio,
            "selector": config.selector.describe(),
            "check_layer": config.check_layer,
            "recomputed_rows": recomputed_rows,
            "exact_prefix_rows": first_reused,
        }
        return PrefillOutcome(
            logits,
            self.name,
            reused_tokens=len(layout) - recomputed,
            recomputed_tokens=recomputed,
            exact=False,
            info=info,
            stored_summaries=stored,
        )

    @staticmethod
    def _recompute(
        ctx: PrefillContext, config: BlendConfig, rows: RowInfo, cache: KVCache, start: int
    ) -> SelectiveRecompute:
        """The recompute selector of this blend; runs the query probe first when the selector needs it."""
        runtime, selector = ctx.runtime, config.selector
        ratio = config.recompute_ratio
        probe = None
        if selector.needs_probe and 0.0 < ratio < 1.0 and not bool(rows.forced.all()):
            windows = [runtime.adapter.window(layer) for layer in range(runtime.num_layers)]
            prober = QueryProbe(rows, selector.probe_layers(windows))
            if cache.query_observer is None:  # the observer sees every row forward_rows computes
                forward_fixed_rows(runtime, cache, start, rows.forced.nonzero().squeeze(1), probe=prober)
            else:
                runtime.forward_rows(cache, start, prober)
            probe = prober.scores
            settled_rows = prober.settled_rows if selector.keeps_probe_rows else prober.exact_rows
            settled = settled_rows(runtime.num_layers)
            if bool(settled.any()):
                rows = RowInfo(rows.forced & ~settled, rows.query, rows.chunk_offset, settled)
        scaling = None
        context = (rows.chunk_offset >= 0).nonzero().squeeze(1)
        if selector.scales_attention and context.numel():
            positions = cache.positions[start + context]
            scaling = ContextScaling(
                positions.sort().values, int(positions.max()) + 1, selector.temperature, selector.scale
            )
        return SelectiveRecompute(rows, config.schedule(runtime.num_layers), selector, probe, scaling)

    def after_prefill(
        self,
        ctx: PrefillContext,
        options: ReuseOptions,
        layout: PromptLayout,
        cache: KVCache,
        outcome: PrefillOutcome,
    ) -> None:
        """After a blend's first token: store the exact rows before the first blended row as prefix
        blocks, and precompute + store the chunks that missed."""
        if outcome.path != self.name:
            return
        exact_rows = int(outcome.info.get("exact_prefix_rows", 0))
        if exact_rows >= ctx.block_size:
            keys = PrefixKeys.of_layout(ctx.fingerprint, ctx.block_size, layout, options.namespace)
            exact = keys.first(exact_rows // ctx.block_size)
            pool = ctx.runtime.page_pool
            if pool is not None:
                publish_prefix(pool, cache, layout.token_ids, exact, outcome.summaries)
            store_prefix(
                ctx,
                cache,
                layout.token_ids[:exact_rows],
                summaries=outcome.summaries,
                namespace=options.namespace,
                keys=exact,
            )
        if outcome.info.get("chunk_misses"):
            sink = sink_tokens(ctx, options.blend.sink)
            tail = chunk_tail(ctx, options.blend)
            for seg, _, _ in layout.chunk_spans():
                ids = stored_chunk_ids(seg.token_ids, tail)
                if ids and find_chunk(ctx, ids, sink, options.namespace) is None:
                    store_chunk(ctx, precompute_chunk(ctx, ids, sink, options.namespace))


def _forced(seg: Segment, entry: KVEntry | None, selector: RowSelector) -> bool:
    """Whether a segment's rows are recomputed at every layer (forced rows) rather than reused: they hold no
    stored KV (``entry`` None), or they are a separator stored with its chunk and ``selector`` recomputes
    separators (the selectors that rank by KV deviation)."""
    return entry is None or (seg.kind == "separator" and selector.recomputes_separators)


def _stored_rows(
    layout: PromptLayout, chunks: list[KVEntry | None], separator_in_chunk: bool
) -> list[tuple[Segment, int, int, KVEntry | None, int]]:
    """Per segment of ``layout``: (segment, start, end, the stored entry its rows come from or None, the
    offset of its first row in that entry). ``chunks``: per chunk segment, its entry or None. With
    ``separator_in_chunk`` the separator after a stored chunk comes from that chunk's entry, after the
    chunk's own rows (the entry was found under the chunk's tokens then the separator's, and the store
    returns only an entry holding exactly those tokens)."""
    out: list[tuple[Segment, int, int, KVEntry | None, int]] = []
    found = iter(chunks)
    carried: tuple[KVEntry, int] | None = None  # the previous segment's chunk entry and its token count
    for seg, s, e in layout.spans():
        entry, at = None, 0
        if seg.kind == "chunk":
            entry = next(found)
        elif seg.kind == "separator" and carried is not None:
            entry, at = carried
        carried = (entry, e - s) if seg.kind == "chunk" and entry is not None and separator_in_chunk else None
        out.append((seg, s, e, entry, at))
    return out
