"""The layer-wise runtime: our own per-layer loop over a family adapter.

One mechanism serves every prefill path. Rows of a :class:`KVCache` are token
slots. ``forward_rows`` runs the layers over rows ``[start, length)``:

* plain prefill: the rows hold no KV yet; every row is computed at every layer;
* selective recompute (CacheBlend, SemShareKV): the rows were pre-loaded with
  reused KV (:meth:`Runtime.load_rows`); a :class:`RecomputeSelector` sees, at each
  layer, the fresh and the reused KV of the rows still being computed and says
  which of them go on. Rows it drops keep their reused KV from then on.

Attention masks are always built from absolute positions (a query sees a key iff
``k_pos <= q_pos`` and, on sliding-window layers, ``q_pos - k_pos < window``), so a
scattered subset of queries never sees later keys.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from semkv.models.adapters import (
    LlamaFamilyAdapter,
    apply_rope,
    apply_rope_into,
    apply_rope_rolled,
    rope_sin_signed,
    rotate_queries,
)
from semkv.models.cache import DecodeArena, KVCache, ObservedQueries, SharedPrefix, cast, row_bytes
from semkv.models.kernels import (
    GEMM_KEY_BUCKET,
    GemmPlans,
    PrefixPiece,
    attention,
    batched_decode_attention,
    batched_decode_with_prefixes,
    decode_products,
    joined_decode_attention,
    round_up,
    uses_gemm_kernels,
)
from semkv.models.linear import prepacks
from semkv.models.page_pool import PageLayout, PagePool
from semkv.models.precision import cast_model
from semkv.models.staging import LoadStaging, RowSource

Attention = Callable[..., Tensor]  # :func:`~semkv.models.kernels.attention`'s signature


class RecomputeSelector(Protocol):
    """Chooses, layer by layer, which rows keep being recomputed."""

    def select(
        self,
        layer: int,
        active: Tensor,
        fresh_k: Tensor,
        fresh_v: Tensor,
        cached_k: Tensor,
        cached_v: Tensor,
        inputs: LayerInputs,
    ) -> Tensor:
        """Return indices into ``active`` of the rows that continue through this layer.

        active: [A] row offsets (relative to ``start``) computed at this layer, ascending.
        fresh_k, cached_k: [kvh, A, d] pre-RoPE keys (fresh: this forward; cached: reused).
        fresh_v, cached_v: [kvh, A, d] values.
        inputs: the layer's queries and keys, for selectors that rank rows by attention.
        The fresh KV of every active row is already written over the cached rows.

        A selector may also have an ``attention`` method with :func:`attention`'s signature:
        ``forward_rows`` then calls it instead of :func:`attention` (e.g. to rescale part of it).
        """
        ...


@dataclass(frozen=True)
class LayerInputs:
    """What a :class:`RecomputeSelector` sees of one layer besides the KV of the active rows.

    queries: [nh, A, d] pre-RoPE queries of the active rows, in the compute dtype; cos, sin: [A, d]
    their rotary tables (:meth:`rotated_queries` applies them on demand, in fp32); q_pos: [A] their
    positions. keys: [kvh, T, d] rotated keys of every cache row at this layer, in the compute dtype
    (the active rows' fresh keys already written); k_pos: [T]. first_row: the cache row of offset 0 (``forward_rows``' start).
    scaling: the layer's softmax scale; window: its sliding window, or None.
    """

    queries: Tensor
    cos: Tensor
    sin: Tensor
    q_pos: Tensor
    keys: Tensor
    k_pos: Tensor
    first_row: int
    scaling: float
    window: int | None

    @classmethod
    def at(
        cls,
        adapter: LlamaFamilyAdapter,
        cache: KVCache,
        layer: int,
        queries: Tensor,
        cos: Tensor,
        sin: Tensor,
        q_pos: Tensor,
        first_row: int,
    ) -> LayerInputs:
        """The inputs of ``layer`` for the active rows (``queries``, ``cos``, ``sin``, ``q_pos`` as above)
        over every row of ``cache`` (its rotated keys at this layer and their positions)."""
        return cls(
            queries,
            cos,
            sin,
            q_pos,
            cache.keys(layer),
            cache.valid_positions(),
            first_row,
            adapter.scaling(layer),
            adapter.window(layer),
        )

    def rotated_queries(self) -> Tensor:
        """[nh, A, d] the active rows' queries at their positions, in float32 (selectors score in fp32)."""
        return apply_rope(self.queries.float(), self.cos, self.sin)


class GatheredRows(NamedTuple):
    """What a :class:`KeyGatherer` hands the runtime for one layer: keys and values [kvh, R, d] and their
    positions [R]. ``mask_known``: ``bias`` is the mask the positions give for the new token —
    additive [1, R] (0: seen, -inf: hidden), or None when every row is seen — so the runtime need not
    build it from the positions."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    bias: Tensor | None = None
    mask_known: bool = False


class KeyGatherer(Protocol):
    """Supplies, per layer of a decode step, the keys to attend to (e.g. from a fast tier)."""

    def gather(
        self, layer: int, q_rot: Tensor, cache: KVCache
    ) -> GatheredRows | tuple[Tensor, Tensor, Tensor] | None:
        """q_rot: [nh, 1, d]. Return :class:`GatheredRows` or a plain (keys [kvh, R, d] rotated, values
        [kvh, R, d], positions [R]) triple, the new token's own row included, or None for every row.
        Called after the new row is written at this layer."""
        ...


class RopeTables:
    """cos/sin [T, d] of fixed positions, computed once per rotary group of layers (not once per layer)."""

    def __init__(self, adapter: LlamaFamilyAdapter, positions: Tensor, like: Tensor) -> None:
        self.adapter, self.positions, self.like = adapter, positions, like
        self.tables: dict[str, tuple[Tensor, Tensor]] = {}
        self.signed: dict[str, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer: int) -> tuple[Tensor, Tensor]:
        group = self.adapter.rope_group(layer)
        if group not in self.tables:
            self.tables[group] = self.adapter.rotary(self.positions, layer, self.like)
        return self.tables[group]

    def rolled(self, layer: int) -> tuple[Tensor, Tensor]:
        """(cos, sin with its first half negated) of ``layer``'s group, for :func:`apply_rope_rolled`."""
        group = self.adapter.rope_group(layer)
        if group not in self.signed:
            cos, sin = self(layer)
            self.signed[group] = (cos, rope_sin_signed(sin))
        return self.signed[group]


class WholeBuffers(NamedTuple):
    """A decode step over a cache's whole buffers: their ``rows`` and the additive mask [1, rows] hiding
    those past the cache's length (None: none)."""

    rows: int
    bias: Tensor | None

    def fits(self, cache: KVCache, layer: int) -> bool:
        """``layer``'s buffers are contiguous [kvh, rows, d] (an arena reallocation moves layers one by one)."""
        k, v = cache.k_rot[layer], cache.v[layer]
        return k.shape[1] == v.shape[1] == self.rows and k.is_contiguous() and v.is_contiguous()


SHARED_BATCH_MIN = 2  # dense in-order sequences in a decode step for them to share one attention call
# A dense sequence longer than this many times the median length of a step's dense sequences decodes on its
# own: in the shared call every slot is read up to the longest member, so a few long prompts among many
# short ones would make every member pay for the longest (docs/benchmarks.md, batching).
STRAGGLER_LENGTH = 2.0


def rows_past_bias(seen: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [n, width] in ``dtype`` on ``seen``'s device: 0 for the first ``seen[i]`` rows of
    sequence i ([n]), -inf for the rows after them."""
    hidden = torch.arange(width, device=seen.device).unsqueeze(0) >= seen.unsqueeze(1)
    return torch.zeros(hidden.shape, dtype=dtype, device=seen.device).masked_fill_(hidden, float("-inf"))


@dataclass(frozen=True)
class PrefixGroup:
    """The sequences of a decode step that read one :class:`SharedPrefix`: members [g] their rows in the
    step's attention batch (None: every row, in order); bias [g, 1, 1, P] additive (0 / -inf) hiding the
    prefix rows past a member's ``base`` (it reads only the first rows of a longer prefix), or None."""

    prefix: SharedPrefix
    members: Tensor | None
    bias: Tensor | None

    @classmethod
    def of(
        cls, prefix: SharedPrefix, rows: list[int], bases: list[int], batch: int, dtype: torch.dtype
    ) -> PrefixGroup:
        """The group of the sequences at ``rows`` (of a batch of ``batch``) reading ``bases`` rows of
        ``prefix`` each."""
        device = prefix.k_rot[0].device
        members = None if rows == list(range(batch)) else torch.tensor(rows, device=device)
        bias = None
        if any(base < prefix.rows for base in bases):
            bias = rows_past_bias(torch.tensor(bases, device=device), prefix.rows, dtype)
            bias = bias.view(len(rows), 1, 1, prefix.rows)
        return cls(prefix, members, bias)

    def piece(self, layer: int) -> PrefixPiece:
        """What :func:`~semkv.models.kernels.batched_decode_with_prefixes` reads of ``layer``."""
        return PrefixPiece(self.prefix.k_rot[layer], self.prefix.float_values(layer), self.members, self.bias)


# A batched decode step over shared prefixes joins every key row it reads into one matrix per layer
# (:class:`JoinedRows`) while that matrix has at most this many times the columns one query reads (its
# prefix and its own rows); past it the masked columns (other sequences' own rows) cost more than the
# two-piece kernel saves (micro-benchmark in docs/benchmarks.md, "Running sequences that share one pooled
# prompt").
JOINED_COLUMNS_FACTOR = 2.0
# The joined matrix holds each slot's own rows up to the longest member's, rounded up to a multiple of this
# many rows: the products' shapes then repeat for that many steps (oneDNN builds a kernel per new shape).
JOINED_WIDTH_BUCKET = 16


@dataclass(frozen=True)
class JoinedRows:
    """A batched decode step's key rows joined into one matrix per layer for
    :func:`~semkv.models.kernels.joined_decode_attention`: the rows of each shared prefix once (in
    ``prefixes`` order), then ``width`` rows of every attended arena slot, slot after slot. bias:
    [slots, columns] additive (0 / -inf): slot i's query sees the first ``base`` rows of its prefix and its
    own valid rows (a slot that is not a member sees every column: its output is discarded)."""

    prefixes: tuple[SharedPrefix, ...]
    width: int
    bias: Tensor

    @classmethod
    def of(
        cls,
        groups: list[tuple[SharedPrefix, list[int], list[int]]],
        lengths: list[int],
        slots: list[int],
        width: int,
        dtype: torch.dtype,
    ) -> JoinedRows:
        """groups: (prefix, member slots relative to the first attended slot, rows of it each reads);
        lengths[j]: own rows of the member in relative slot ``slots[j]``; ``max(slots) + 1`` slots."""
        device = groups[0][0].k_rot[0].device
        count = max(slots) + 1
        offsets, at = [], 0
        for prefix, _, _ in groups:
            offsets.append(at)
            at += prefix.rows
        columns = at + count * width
        first = torch.zeros(count, dtype=torch.long, device=device)  # per slot: prefix columns [first, end)
        end = torch.zeros(count, dtype=torch.long, device=device)
        for offset, (_, members, bases) in zip(offsets, groups, strict=True):
            first[members] = offset
            end[members] = offset + torch.tensor(bases, device=device)
        own = at + torch.arange(count, device=device) * width  # per slot: own columns [own, own + length)
        seen = torch.full((count,), columns, dtype=torch.long, device=device)
        seen[slots] = torch.tensor(lengths, device=device)
        column = torch.arange(columns, device=device)
        visible = (column >= first[:, None]) & (column < end[:, None])
        visible |= (column >= own[:, None]) & (column < (own + seen)[:, None])
        members_at = set(slots)
        visible[[i for i in range(count) if i not in members_at]] = True  # not a member: output discarded
        bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        return cls(tuple(prefix for prefix, _, _ in groups), width, bias)

    @property
    def columns(self) -> int:
        return self.bias.shape[1]

    def join(self, parts: list[Tensor], own: Tensor) -> Tensor:
        """One layer's joined rows [kvh, columns, d] in ``own``'s dtype: ``parts`` (each prefix's rows
        [kvh, P, d], in ``prefixes`` order), then ``own`` [slots, kvh, width, d] slot after slot."""
        slots, kvh, width, d = own.shape
        joined = own.new_empty((kvh, self.columns, d))
        at = 0
        for part in parts:
            joined[:, at : at + part.shape[1]].copy_(part)
            at += part.shape[1]
        joined[:, at:].view(kvh, slots, width, d).copy_(own.transpose(0, 1))
        return joined

    def attend(self, queries: Tensor, layer: int, keys: Tensor, values: Tensor) -> Tensor:
        """Attention [slots, nh * d] of one scaled query per attended slot (queries [slots, nh, d]) over
        ``layer``'s prefixes and the slots' first ``width`` own rows (keys, values [slots, kvh, >= width,
        d]: arena slots, finite past each length)."""
        own = slice(0, self.width)
        joined_keys = self.join([prefix.k_rot[layer] for prefix in self.prefixes], keys[:, :, own])
        joined_values = self.join([prefix.v[layer] for prefix in self.prefixes], values[:, :, own])
        return joined_decode_attention(queries, joined_keys, joined_values, self.bias)


@dataclass(frozen=True)
class SharedStep:
    """The sequences of one decode step that attend together over their :class:`DecodeArena` slots.

    members: [n] their indices in the step's batch (``member_list`` on the host); slots, rows: [n] their slot and new row; lo, hi: the
    slot range attended over (slots in it that are not members are computed and discarded); pick: [n]
    member slots relative to ``lo``; width: key rows per slot attended over; bias: [hi - lo, 1, 1, width]
    (0 / -inf: rows past each slot's length) or None; span: the largest distance from a member's first
    key position to its query (a window layer covers every key when span < window); slot_order: member
    j is in slot lo + j (no reordering needed); everyone: the members are the whole batch. A member
    reading a shared prefix holds its own rows in its slot (``rows`` and the mask count own rows);
    prefixes: for the two-piece kernel, a :class:`PrefixGroup` for each prefix members read (members as
    slots relative to ``lo``; empty when ``joined`` is set); joined: the step's key rows joined into one
    matrix per layer, where that is the cheaper form (see :data:`JOINED_COLUMNS_FACTOR`), else None.
    """

    members: Tensor
    member_list: list[int]
    slots: Tensor
    rows: Tensor
    lo: int
    hi: int
    pick: Tensor
    width: int
    bias: Tensor | None
    span: int
    slot_order: bool
    everyone: bool
    prefixes: tuple[PrefixGroup, ...] = ()
    joined: JoinedRows | None = None

    def covers(self, window: int | None) -> bool:
        """Every member's query sees all its keys on a layer with this window."""
        return window is None or self.span < window


class Runtime:
    """Prefill and decode over one model through its family adapter (batch of one sequence).

    compute_dtype: the dtype matmuls and attention run in. If the adapter's model is in another dtype,
    the runtime runs a private copy cast to it (:func:`~semkv.models.precision.cast_model`); the
    adapter it was given, and its model, stay as they are. The residual stream, norms and RoPE run in
    float32 either way; the live cache holds rotated keys and values in the compute dtype.

    KV memory: the runtime keeps a weak reference to every cache it made (:meth:`new_cache`,
    :meth:`track`), so :meth:`kv_held_bytes` counts what is really held: the decode arena's buffers
    (free slots and padding included) plus the own buffers of live caches outside it.
    """

    def __init__(
        self,
        adapter: LlamaFamilyAdapter,
        kv_dtype: torch.dtype,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        if adapter.dtype != compute_dtype:
            adapter = type(adapter)(
                cast_model(adapter.hf_model, compute_dtype), private=True, pack_weights=adapter.pack_weights
            )
        self.adapter = adapter
        self.kv_dtype = kv_dtype
        self.compute_dtype = compute_dtype
        self.device = next(adapter.hf_model.parameters()).device
        self.arena: DecodeArena | None = None  # slots of the caches decoding together (decode_batch)
        # decode attention with masks built once per step, before the layers (no host read in the layer
        # loop); the CPU keeps its kernels, which read positions on the host where that is cheap
        self.sync_free_decode = self.device.type != "cpu"
        self.caches: weakref.WeakSet[KVCache] = weakref.WeakSet()  # live caches made here
        self.page_pool: PagePool | None = None  # the hot tier of exact prefix KV (attach_page_pool)
        self.load_staging = LoadStaging(kv_dtype, self.device)  # reused KV's way into a cache (load_pieces)

    def attach_page_pool(self, block_size: int, budget_bytes: int) -> PagePool | None:
        """Keep exact prefix blocks of ``block_size`` tokens in a page pool of at most ``budget_bytes``
        on this runtime's device (:mod:`semkv.models.page_pool`); None (no pool) when not one page fits.
        The pool's buffers are allocated on its first write."""
        a = self.adapter
        layout = PageLayout(
            a.num_layers,
            a.num_kv_heads,
            a.head_dim,
            block_size,
            self.kv_dtype,
            self.compute_dtype,
            self.device,
        )
        pages = layout.within(budget_bytes)
        self.page_pool = PagePool(layout, pages) if pages > 0 else None
        return self.page_pool

    def track(self, cache: KVCache) -> KVCache:
        """Count ``cache`` (made elsewhere, e.g. a deep copy) in :meth:`kv_held_bytes`; returns it."""
        self.caches.add(cache)
        return cache

    def kv_held_bytes(self) -> int:
        """KV bytes held now: the decode arena's buffers (every slot, free or not, at its full capacity)
        plus the own buffers of the live caches not bound to it, plus each shared prefix they read once."""
        arena = self.arena.nbytes() if self.arena is not None else 0
        caches = list(self.caches)
        prefixes = {id(cache.prefix): cache.prefix for cache in caches if cache.prefix is not None}
        shared = sum(prefix.nbytes() for prefix in prefixes.values())
        return arena + shared + sum(cache.held_bytes() for cache in caches)

    def kv_bytes_to_claim(self, capacities: list[int]) -> int:
        """How much :meth:`kv_held_bytes` grows if caches of these capacities are made now, in this order,
        with ``claim_slot``: nothing for those that find a free arena slot wide enough, their own buffers
        for the others."""
        fits = self.arena.claimable(capacities) if self.arena is not None else [False] * len(capacities)
        per_row = self.kv_bytes_per_token()
        return sum(
            max(capacity, 1) * per_row for capacity, ok in zip(capacities, fits, strict=True) if not ok
        )

    def trim_arena(self, kv_limit: int | None = None) -> None:
        """Give back arena memory no cache uses: drop an arena with no bound cache; shrink one with few
        (:meth:`DecodeArena.shrink`) unless the reallocation's peak would pass ``kv_limit``."""
        arena = self.arena
        if arena is None:
            return
        if not arena.occupied():
            self.arena = None
            return
        arena.shrink(None if kv_limit is None else kv_limit - self.kv_held_bytes())

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    def new_cache(self, capacity: int, claim_slot: bool = False) -> KVCache:
        """An empty cache for ``capacity`` rows. ``claim_slot``: in a free decode-arena slot wide enough, if
        there is one (no memory of its own; see :meth:`DecodeArena.claim`), else with its own buffers."""
        a = self.adapter
        claim = claim_slot and self.arena is not None and self.arena.claimable([capacity])[0]
        cache = KVCache(
            a.num_layers,
            a.num_kv_heads,
            a.head_dim,
            1 if claim else capacity,  # a claimed slot replaces its buffers at once
            self.kv_dtype,
            self.compute_dtype,
            self.device,
        )
        if claim and self.arena is not None:
            self.arena.claim(cache, capacity)
        return self.track(cache)

    def request_capacity(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The capacity to give a request's cache: its prompt and new tokens, and where attention runs as
        matmul kernels at least the prompt rounded up to a multiple of :data:`GEMM_KEY_BUCKET`, so the
        prompt's forward passes read whole buckets of keys (:meth:`attended_rows`)."""
        rows = prompt_tokens + max_new_tokens
        if not uses_gemm_kernels(self.device, self.compute_dtype):
            return rows
        return max(rows, round_up(prompt_tokens, GEMM_KEY_BUCKET))

    def attended_rows(self, cache: KVCache) -> int:
        """Rows of ``cache`` a forward's attention reads: with the matmul kernels, its length rounded up to a
        multiple of :data:`GEMM_KEY_BUCKET` where the capacity holds that many (the rows past the length
        masked by :func:`padded_positions`), so the last query group's key range, which ends at the last
        row, has a width that repeats across prompts (oneDNN builds a kernel per new matmul shape); else
        its length."""
        if not uses_gemm_kernels(self.device, self.compute_dtype):
            return cache.length
        rows = round_up(cache.length, GEMM_KEY_BUCKET)
        return rows if rows <= cache.capacity else cache.length

    def rope_tables(self, positions: Tensor) -> RopeTables:
        """Float32 rotary tables of ``positions``: RoPE is applied in fp32 and rounded once."""
        return RopeTables(self.adapter, positions, torch.empty(0, device=self.device))

    def rope(self, k_pre: Tensor, positions: Tensor, layer: int) -> Tensor:
        """Rotate pre-RoPE keys (or queries) [heads, T, d] to ``positions`` [T] with ``layer``'s rotary
        table; computed in float32, returned in the compute dtype."""
        k = k_pre.float()
        cos, sin = self.adapter.rotary(positions, layer, k)
        return apply_rope(k, cos, sin).to(self.compute_dtype)

    # -- loading reused KV: where stored KV crosses to the runtime's device ------------------------
    def load_rows(
        self, cache: KVCache, k_pre: Tensor, v: Tensor, positions: Tensor, token_ids: list[int]
    ) -> int:
        """Append rows holding reused KV, re-rotated to ``positions``: :meth:`load_pieces` with one piece.

        k_pre, v: [L, kvh, n, d] on any device, in any float dtype; positions [n]. Returns the first
        appended row.
        """
        return self.load_pieces(cache, [RowSource(k_pre, v)], positions, token_ids)

    def load_pieces(
        self, cache: KVCache, pieces: list[RowSource], positions: Tensor, token_ids: list[int]
    ) -> int:
        """Append ``len(token_ids)`` rows at ``positions`` [n], filled piece after piece: a piece with KV
        ([L, kvh, m, d] pre-RoPE keys and values, e.g. views of stored entries on the host) is copied in
        and its keys re-rotated to the rows' positions; a piece without (``RowSource.empty(m)``) leaves
        zeros for a forward to overwrite. This is the one place where stored KV crosses to the device.

        The rows get what a prefill writes for the same pre-RoPE keys: keys rounded to the KV dtype and
        rotated from there in float32, rounded to the compute dtype; values rounded through the KV dtype.
        Re-applying RoPE to stored pre-RoPE keys is exact, not an approximation.

        The pieces move in bulk: for a group of layers at a time (:class:`LoadStaging`), each piece is
        copied once for all of them into a staging buffer [g, kvh, n, d] in the KV dtype (a blend's 60 pieces
        cost 60 copies per group, not 60 per layer), then each layer's rows are copied into the cache and
        rotated from a float32 copy (:func:`apply_rope_into`) with float32 buffers allocated once per call and
        one rotary table for all rows. Returns the first row.
        """
        count = len(token_ids)
        if sum(piece.rows for piece in pieces) != count or positions.shape[0] != count:
            raise ValueError(f"load_pieces: pieces, positions and token ids disagree on {count} rows")
        positions = positions.to(self.device)
        start = cache.append_rows(positions, token_ids)
        rows = slice(start, start + count)
        shape = (cache.num_kv_heads, count, cache.head_dim)
        k32, rotated, turned = (torch.empty(shape, dtype=torch.float32, device=self.device) for _ in range(3))
        tables = self.rope_tables(positions)
        orders = [piece.taken(self.device) for piece in pieces]
        for layers in self.load_staging.layer_groups(self.num_layers, shape):
            staged_k, staged_v = self.load_staging.stage(pieces, orders, layers, shape)
            for index, layer in enumerate(range(layers.start, layers.stop)):
                k_pre, k_rot, v = cache.row_buffers(layer, rows)
                k_pre.copy_(staged_k[index])
                turned.copy_(staged_v[index])
                v.copy_(turned)  # through float32: a direct fp16 -> bf16 copy is slow on CPU (see cast)
                k32.copy_(staged_k[index])
                k_rot.copy_(apply_rope_into(k32, *tables.rolled(layer), rotated, turned))
        self.load_staging.release_excess()
        return start

    def write_fresh(
        self, cache: KVCache, layer: int, rows: Tensor | slice, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """Write fresh pre-RoPE keys / values [kvh, n, d] into ``rows``: keys rounded to the KV dtype and
        rotated from there, as :meth:`load_rows` does for reused ones. Returns the rounded keys."""
        k_pre = cast(k, self.kv_dtype)
        cache.write(layer, rows, k_pre, apply_rope(k_pre.float(), cos, sin), v)
        return k_pre

    def rotated_queries(self, q: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated queries [nh, n, d] in the compute dtype (RoPE in fp32)."""
        return rotate_queries(q, cos, sin, self.compute_dtype)

    # -- the layer loop ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run_layers(self, hidden: Tensor, layer_pass: LayerPass) -> Tensor | None:
        """The one per-layer loop every forward runs: prefill, the tail of a hit, a blend's or share's
        recompute, a probe, a batched decode step.

        hidden: [R, H] float32 embeddings of the rows the pass starts with. At each layer the adapter
        computes queries, keys and values of the current rows; the pass writes the layer's fresh KV,
        may narrow the rows that go on, and attends (:meth:`LayerPass.step`); the adapter finishes the
        layer (output projection, residual, MLP). Returns the last layer's hidden rows [R', H], or None
        when the pass stopped early (a probe past its last layer).
        """
        a = self.adapter
        bucket = getattr(layer_pass, "bucket_rows", False) and prepacks(self.device, self.compute_dtype)
        for layer in range(layer_pass.layers):
            rows = hidden.shape[0]
            q, k, v = a.qkv(layer, _padded_rows(hidden, bucket))
            if q.shape[1] != rows:
                q, k, v = q[:, :rows], k[:, :rows], v[:, :rows]
            stepped = layer_pass.step(layer, hidden, q, k, v)
            if stepped is None:
                return None
            hidden, out = stepped
            rows = hidden.shape[0]
            hidden = a.finish_layer(layer, _padded_rows(hidden, bucket), _padded_rows(out, bucket))[:rows]
        return hidden

    @torch.inference_mode()
    def forward_rows(
        self,
        cache: KVCache,
        start: int,
        selector: RecomputeSelector | None = None,
        rows: Tensor | None = None,
        attend: Attention | None = None,
        stop_after: int | None = None,
    ) -> Tensor | None:
        """Run cache rows from ``start`` on through the layers; return the last row's logits [V].

        rows: None: every row [start, length) enters layer 0 (a plain prefill, or a selective recompute
            whose selector narrows them layer by layer); else [R] offsets from ``start`` (ascending) of a
            fixed set of rows computed from layer 0 on, every other row keeping the KV it holds.
        selector: with one, the rows are assumed pre-loaded with reused KV and the selector decides, per
            layer, which rows keep being recomputed (the last row must stay selected). It compares keys
            and values in float32.
        attend: the attention kernel (default: the selector's ``attention`` if it has one, else
            :func:`attention`). stop_after: stop after this layer's KV is written and return None (a
            probe needs no logits).
        If the cache has a ``query_observer`` it is called at every layer with the queries of the rows
        computed there (:class:`~semkv.models.cache.ObservedQueries`: SnapKV/H2O and the probe's capture).
        """
        if cache.length - start <= 0:
            raise ValueError("forward_rows needs at least one row to compute")
        layer_pass = RowsPass(self, cache, start, selector, rows, attend, stop_after)
        hidden = self.run_layers(layer_pass.first_hidden(), layer_pass)
        layer_pass.check_last_row_kept()
        return None if hidden is None else self.adapter.logits(hidden[-1:])[0]

    def prefill(self, cache: KVCache, token_ids: list[int], positions: Tensor | None = None) -> Tensor:
        """Append ``token_ids`` at ``positions`` (default: right after the cache) and compute them.

        Returns the last token's logits [V].
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        if positions is None:
            first = int(cache.valid_positions().max()) + 1 if cache.length else 0
            positions = self.positions(first, len(token_ids))
        start = cache.append_rows(positions, token_ids)
        logits = self.forward_rows(cache, start)
        assert logits is not None
        return logits

    def decode(self, cache: KVCache, token_id: int, gatherer: KeyGatherer | None = None) -> Tensor:
        """Append one token at the next position and return its logits [V].

        Without a ``gatherer`` each layer attends to every row; with one (a sparse decoder), to the
        keys, values and positions it hands over. A batch of one :meth:`decode_batch`.
        """
        return self.decode_batch([cache], [token_id], [gatherer])[0]

    @torch.inference_mode()
    def decode_batch(
        self,
        caches: list[KVCache],
        token_ids: list[int],
        gatherers: list[KeyGatherer | None] | None = None,
        kv_limit: int | None = None,
    ) -> Tensor:
        """One decode step of B sequences: append ``token_ids[i]`` to ``caches[i]`` at its next position;
        return the logits [B, V]. ``kv_limit``: the decode arena never grows past it (see
        :meth:`_shared_step`).

        Norms, projections, MLP and lm_head run once over the B stacked rows; RoPE, the cache write and
        attention run per sequence, over its own cache and with its own ``gatherers[i]`` (None: every
        row), or together for the sequences bound to the decode arena (:class:`DecodePass`). Row i's
        result does not depend on the other rows: each output element of a matmul is its row's dot
        products, so up to the BLAS kernel's summation order a batched step gives the logits of B
        one-sequence steps.
        """
        count = len(caches)
        if count == 0 or len(token_ids) != count:
            raise ValueError(f"decode_batch needs one token per cache, got {len(token_ids)} for {count}")
        gatherers = gatherers if gatherers is not None else [None] * count
        if len(gatherers) != count:
            raise ValueError(f"decode_batch needs one gatherer (or None) per cache, got {len(gatherers)}")
        layer_pass = DecodePass(self, caches, token_ids, gatherers, kv_limit)
        hidden = self.run_layers(layer_pass.first_hidden(), layer_pass)
        assert hidden is not None
        return self.adapter.logits(hidden)

    # -- a step's index and position tensors, built here on the runtime's device -------------------
    def positions(self, first: int, count: int) -> Tensor:
        """[count] positions first, first + 1, ... on the runtime's device."""
        return torch.arange(first, first + count, dtype=torch.long, device=self.device)

    def index(self, values: list[int] | list[bool] | Tensor, dtype: torch.dtype = torch.long) -> Tensor:
        """A host list (token ids, row offsets, flags) or tensor as a tensor on the runtime's device."""
        if isinstance(values, Tensor):
            return values.to(self.device, dtype)
        return torch.tensor(values, dtype=dtype, device=self.device)

    def generator(self, seed: int) -> torch.Generator:
        """A random generator on the runtime's device seeded with ``seed`` (sampling draws on the device
        its logits are on)."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def whole_buffers(self, cache: KVCache, ordered: bool) -> WholeBuffers | None:
        """How this step's global layers attend over the cache's whole buffers (their rows and mask), or
        None (over its valid rows).

        torch's CPU batched matmul copies an operand that is a leading slice of a buffer ([kvh, length, d]
        of [kvh, rows, d]) before multiplying, and reads a whole contiguous buffer as it is. So on
        CPU in bf16 / fp16, when every row precedes the new one (``ordered``: positions in order, the new
        row last) and the padding is at most a quarter of the rows, the whole buffer is read with the rows
        past the length masked (finite: :meth:`KVCache.reserve` zeroes them; an arena slot's are zeros or
        another sequence's rows). A buffer may have more rows than the cache's capacity (an arena slot).
        None for a cache reading a shared prefix (its rows are two pieces)."""
        if cache.prefix is not None:
            return None
        rows = cache.k_rot[0].shape[1]
        if not (
            uses_gemm_kernels(self.device, self.compute_dtype) and ordered and 4 * rows <= 5 * cache.length
        ):
            return None
        bias = None
        if rows > cache.length:
            bias = torch.zeros(1, rows, dtype=self.compute_dtype, device=self.device)
            bias[:, cache.length :] = float("-inf")
        return WholeBuffers(rows, bias)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's row takes in a live cache (pre-RoPE K in the KV dtype, rotated K and V in the
        compute dtype, every layer)."""
        a = self.adapter
        return row_bytes(a.num_layers, a.num_kv_heads, a.head_dim, self.kv_dtype, self.compute_dtype)


class LayerPass(Protocol):
    """One forward through the layers, run by :meth:`Runtime.run_layers`: what each layer writes, which
    rows go on, and what they attend to. A pass may set ``bucket_rows`` (see :data:`ROW_BUCKET`)."""

    layers: int  # layers run, from layer 0

    def first_hidden(self) -> Tensor:
        """[R, H] float32 embeddings of the rows entering layer 0."""
        ...

    def step(
        self, layer: int, hidden: Tensor, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """Write ``layer``'s fresh KV of the pass's rows and attend.

        hidden: [R, H] the rows entering the layer; q: [nh, R, d], k, v: [kvh, R, d] their pre-RoPE
        projections. Returns (hidden [R', H] of the rows that go on, their attention output [R', nh * d]),
        or None to stop the pass here.
        """
        ...


class RowsPass:
    """:meth:`Runtime.forward_rows`' pass: rows of one cache from ``start`` on (all of them or a fixed
    set), optionally narrowed layer by layer by a :class:`RecomputeSelector`.

    Each layer writes the active rows' fresh keys rounded to the KV dtype and rotated from there in
    float32 (:meth:`Runtime.write_fresh`), rotates their queries in float32 and rounds them to the compute
    dtype, and attends over every valid row of the cache with a mask from positions. After the last
    layer only the last row's output is needed, so only it goes through the last attention.
    """

    def __init__(
        self,
        runtime: Runtime,
        cache: KVCache,
        start: int,
        selector: RecomputeSelector | None,
        rows: Tensor | None,
        attend: Attention | None,
        stop_after: int | None,
    ) -> None:
        a = runtime.adapter
        self.runtime, self.cache, self.start, self.selector = runtime, cache, start, selector
        self.count = cache.length - start
        positions = cache.positions[start : cache.length]
        self.every_row = rows is None
        self.active = runtime.positions(0, self.count) if rows is None else runtime.index(rows)
        self.q_pos = positions if rows is None else positions[self.active]
        # rotary tables of the entering rows only; ``table_rows`` picks the active ones once rows drop out
        self.tables = runtime.rope_tables(self.q_pos)
        self.table_rows: Tensor | None = None
        # one key-position tensor for every layer, so attention plans carry over
        self.k_pos = cache.valid_positions()
        self.fresh_prefix = (
            rows is None
            and start == 0
            and selector is None
            and bool((positions == runtime.positions(0, self.count)).all())
        )
        self.observer = cache.query_observer
        self.attend: Attention = attend or getattr(selector, "attention", None) or attention
        # the default kernel reads keys past the valid rows, masked, so its matmul shapes repeat
        self.key_rows = runtime.attended_rows(cache) if self.attend is attention else cache.length
        self.attended_pos = padded_positions(self.k_pos, self.key_rows)
        self.compares_cached = getattr(selector, "compares_cached", True)
        # a selector may say at which layers it reads the reused KV (SelectiveRecompute: scheduled ones)
        self.compares_at: Callable[[int], bool] = getattr(selector, "compares_at", lambda layer: True)
        self.stop_after = stop_after
        self.layers = a.num_layers if stop_after is None else min(stop_after, a.num_layers - 1) + 1
        self.plans = GemmPlans()
        self.bucket_rows = selector is not None  # rows change from layer to layer (see ROW_BUCKET)
        self.last_kept: Tensor | None = None  # [] bool on the device: the selector kept the last row so far

    def first_hidden(self) -> Tensor:
        ids = self.runtime.index(self.cache.token_ids[self.start : self.cache.length])
        return self.runtime.adapter.embed(ids if self.every_row else ids[self.active]).float()

    def step(
        self, layer: int, hidden: Tensor, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        runtime, cache, a = self.runtime, self.cache, self.runtime.adapter
        cos, sin = self.tables(layer)
        if self.table_rows is not None:
            cos, sin = cos[self.table_rows], sin[self.table_rows]
        rows = self.active + self.start
        if self.observer is not None:
            self.observer(layer, ObservedQueries(q, cos, sin, self.q_pos, runtime.compute_dtype))
        if self.selector is None:
            written = slice(self.start, cache.length) if self.every_row else rows
            runtime.write_fresh(cache, layer, written, k, v, cos, sin)
        else:
            hidden, q, cos, sin = self._select(layer, rows, hidden, q, k, v, cos, sin)
        if self.stop_after is not None and layer >= self.stop_after:
            return None
        if layer == a.num_layers - 1 and self.active.numel() > 1:
            # Only the last row's output matters after the last layer.
            last = torch.tensor([self.active.numel() - 1], device=self.active.device)
            hidden, q, cos, sin = self._narrow(last, hidden, q, cos, sin)
            self.fresh_prefix = False
        out = self.attend(
            runtime.rotated_queries(q, cos, sin),
            cache.keys(layer, self.key_rows),
            cache.values(layer, self.key_rows),
            self.q_pos,
            self.attended_pos,
            a.scaling(layer),
            a.window(layer),
            causal_prefix=self.fresh_prefix,
            plans=self.plans,
        )
        return hidden, out

    def _select(
        self,
        layer: int,
        rows: Tensor,
        hidden: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cos: Tensor,
        sin: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Write the active rows' fresh KV, ask the selector which go on, and narrow to them."""
        runtime, cache, selector = self.runtime, self.cache, self.selector
        assert selector is not None
        cached_k = cached_v = None
        compares = self.compares_cached and self.compares_at(layer)
        if compares:
            cached_k = cache.k_pre[layer][:, rows].float()
            cached_v = cache.v[layer][:, rows].float()
        k_pre = runtime.write_fresh(cache, layer, rows, k, v, cos, sin)
        inputs = LayerInputs.at(runtime.adapter, cache, layer, q, cos, sin, self.q_pos, self.start)
        fresh_k, fresh_v = (k_pre.float(), v.float()) if compares else (k_pre, v)
        keep = selector.select(layer, self.active, fresh_k, fresh_v, cached_k, cached_v, inputs)
        if keep.numel() == 0:
            raise RuntimeError("a recompute selector must keep the last row")
        kept_last = self.active[keep[-1]] == self.count - 1  # checked once, after the loop (no sync here)
        self.last_kept = kept_last if self.last_kept is None else self.last_kept & kept_last
        if keep.numel() != self.active.numel():
            hidden, q, cos, sin = self._narrow(keep, hidden, q, cos, sin)
        return hidden, q, cos, sin

    def _narrow(
        self, keep: Tensor, hidden: Tensor, q: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Keep the active rows ``keep`` [K] (indices into the active rows) from here on."""
        self.active, self.q_pos = self.active[keep], self.q_pos[keep]
        self.table_rows = keep if self.table_rows is None else self.table_rows[keep]
        return hidden[keep], q[:, keep], cos[keep], sin[keep]

    def check_last_row_kept(self) -> None:
        """Raise if the selector dropped the last row at some layer (one host read, after the loop)."""
        if self.last_kept is not None and not bool(self.last_kept):
            raise RuntimeError("a recompute selector must keep the last row")


class DecodePass:
    """:meth:`Runtime.decode_batch`'s pass: one new row per cache.

    Sequences bound to the runtime's :class:`DecodeArena` (dense, in position order) write and attend
    together (:class:`SharedStep`); the others write their row and attend over their own cache, or over
    the rows their :class:`KeyGatherer` hands over. Everything a step needs besides the layer's
    projections (slots, positions, rotary tables, masks) is built once, before the first layer.
    """

    def __init__(
        self,
        runtime: Runtime,
        caches: list[KVCache],
        token_ids: list[int],
        gatherers: list[KeyGatherer | None],
        kv_limit: int | None,
    ) -> None:
        self.runtime, self.caches, self.token_ids, self.gatherers = runtime, caches, token_ids, gatherers
        self.layers = runtime.num_layers
        for cache, gatherer in zip(caches, gatherers, strict=True):
            if _copies_prefix_in(cache, gatherer):
                cache.unshare()
        self.slots = [cache.append_next(token) for cache, token in zip(caches, token_ids, strict=True)]
        self.q_pos = torch.cat(
            [cache.positions[row : row + 1] for cache, row in zip(caches, self.slots, strict=True)]
        )
        self.tables = runtime.rope_tables(self.q_pos)
        self.k_pos = [cache.valid_positions() for cache in caches]
        self.ordered = [cache.ordered() for cache in caches]  # once per step, not per layer
        self.shared = self._shared_step(caches, self.slots, gatherers, self.ordered, kv_limit)
        self.members = set(self.shared.member_list) if self.shared is not None else set()
        self.biases: dict[tuple[int, int | None], Tensor] = {}  # (sequence, window) -> mask of this step
        self.alone: dict[int, PrefixGroup] = {}  # sequence -> its prefix, when it attends on its own
        self.whole = [  # the arena's members attend together (or, on window layers, over their window)
            None if i in self.members else runtime.whole_buffers(cache, self.ordered[i])
            for i, cache in enumerate(caches)
        ]

    def first_hidden(self) -> Tensor:
        return self.runtime.adapter.embed(self.runtime.index(self.token_ids)).float()

    def step(self, layer: int, hidden: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        runtime, a, shared = self.runtime, self.runtime.adapter, self.shared
        # RoPE is row-wise: rotate every row, queries and keys, at once (keys rounded to the KV dtype
        # first, as write_fresh does); the same bits as rotating each (apply_rope_rolled)
        k_pre = cast(k, runtime.kv_dtype)
        turned = apply_rope_rolled(torch.cat((q.float(), k_pre.float())), *self.tables.rolled(layer))
        q_rot_all, k_rot = turned[: q.shape[0]].to(runtime.compute_dtype), turned[q.shape[0] :]
        together = shared is not None and shared.covers(a.window(layer))
        got = None
        if shared is not None:
            got = self._shared_attention(shared, layer, q_rot_all, k_pre, k_rot, v, together)
            if got is not None and shared.everyone:
                return hidden, got
        out = q_rot_all.new_empty(len(self.caches), q_rot_all.shape[0] * q_rot_all.shape[2])
        if got is not None and shared is not None:
            out[shared.members] = got
        for i, (cache, row, gatherer) in enumerate(zip(self.caches, self.slots, self.gatherers, strict=True)):
            if i in self.members and together:
                continue
            one = slice(i, i + 1)
            if i not in self.members:
                cache.write(layer, slice(row, row + 1), k_pre[:, one], k_rot[:, one], v[:, one])
            out[one] = self._own_attention(layer, i, q_rot_all[:, one], gatherer)
        return hidden, out

    def _own_attention(self, layer: int, i: int, q_rot: Tensor, gatherer: KeyGatherer | None) -> Tensor:
        """Attention [1, nh * d] of sequence ``i``'s new row (q_rot [nh, 1, d]) over its own cache, or over
        what its gatherer hands over."""
        a, cache = self.runtime.adapter, self.caches[i]
        one = slice(i, i + 1)
        if gatherer is not None:
            picked = gatherer.gather(layer, q_rot, cache)
            if picked is not None:
                return self._gathered_attention(layer, q_rot, self.q_pos[one], picked)
        if cache.prefix is not None:
            return self._prefix_attention(layer, i, q_rot)
        span = self.whole[i]
        if span is not None and a.window(layer) is None and span.fits(cache, layer):
            return decode_products(q_rot * a.scaling(layer), cache.k_rot[layer], cache.v[layer], span.bias)
        if self.runtime.sync_free_decode:
            return self._masked_attention(layer, i, q_rot)
        return attention(
            q_rot,
            cache.keys(layer),
            cache.values(layer),
            self.q_pos[one],
            self.k_pos[i],
            a.scaling(layer),
            a.window(layer),
            ordered=self.ordered[i],
        )

    def _prefix_attention(self, layer: int, i: int, q_rot: Tensor) -> Tensor:
        """Attention [1, nh * d] of sequence ``i``'s new row (q_rot [nh, 1, d]) over a cache that reads a
        shared prefix: over both pieces in one softmax when every key is seen, else over the rows the
        window can reach (the last ``window`` rows of an in-order cache) with a mask from positions."""
        a, cache = self.runtime.adapter, self.caches[i]
        prefix = cache.prefix
        assert prefix is not None
        window = a.window(layer)
        if self.ordered[i] and (window is None or cache.position_span() < window):
            own = cache.own_length
            group = self.alone.get(i)
            if group is None:
                group = PrefixGroup.of(prefix, [0], [cache.base], 1, self.runtime.compute_dtype)
                self.alone[i] = group
            return batched_decode_with_prefixes(
                q_rot.transpose(0, 1) * a.scaling(layer),
                cache.own_k_rot[layer][:, :own].unsqueeze(0),
                cache.own_v[layer][:, :own].unsqueeze(0),
                None,
                [group.piece(layer)],
            )
        first = max(0, cache.length - window) if self.ordered[i] and window is not None else 0
        keys, values = cache.kv_rows(layer, first)
        return attention(
            q_rot,
            keys,
            values,
            self.q_pos[i : i + 1],
            self.k_pos[i][first:],
            a.scaling(layer),
            window,
            ordered=self.ordered[i],
        )

    def _masked_attention(self, layer: int, i: int, q_rot: Tensor) -> Tensor:
        """Attention [1, nh * d] of sequence ``i``'s new row over its own cache through torch's fused kernel,
        with the additive mask [1, 1, 1, T] of its positions for this layer's window, built once per step
        and window on the device (nothing read back to the host)."""
        a, cache = self.runtime.adapter, self.caches[i]
        window = a.window(layer)
        bias = self.biases.get((i, window))
        if bias is None:
            q_pos, k_pos = self.q_pos[i : i + 1], self.k_pos[i]
            hidden = k_pos > q_pos
            if window is not None:
                hidden |= q_pos - k_pos >= window
            bias = torch.zeros(hidden.shape, dtype=q_rot.dtype, device=q_rot.device)
            bias = bias.masked_fill_(hidden, float("-inf")).view(1, 1, 1, -1)
            self.biases[(i, window)] = bias
        keys, values = cache.keys(layer).unsqueeze(0), cache.values(layer).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q_rot.unsqueeze(0),
            keys,
            values,
            attn_mask=bias,
            scale=a.scaling(layer),
            enable_gqa=q_rot.shape[0] != keys.shape[1],
        )
        return out[0].transpose(0, 1).reshape(1, -1)

    def _gathered_attention(
        self, layer: int, q_rot: Tensor, q_pos: Tensor, picked: GatheredRows | tuple[Tensor, Tensor, Tensor]
    ) -> Tensor:
        """Attention [1, nh * d] of one query [nh, 1, d] over the rows a sparse decoder gathered: a plain
        (keys, values, positions) triple, or :class:`GatheredRows` whose ``mask_known`` says its ``bias``
        already is the mask the positions give: on CPU in bf16 / fp16 that goes straight to
        :func:`~semkv.models.kernels.decode_products` (the same products as :func:`attention`, without
        building and checking the mask at every layer)."""
        keys, values, key_pos = picked[0], picked[1], picked[2]
        scaling = self.runtime.adapter.scaling(layer)
        window = self.runtime.adapter.window(layer)
        if (
            uses_gemm_kernels(q_rot.device, q_rot.dtype)
            and window is None
            and isinstance(picked, GatheredRows)
            and picked.mask_known
        ):
            return decode_products(q_rot * scaling, keys, values, picked.bias)
        return attention(q_rot, keys, values, q_pos, key_pos, scaling, window)

    def _shared_step(
        self,
        caches: list[KVCache],
        rows: list[int],
        gatherers: list[KeyGatherer | None],
        ordered: list[bool],
        kv_limit: int | None = None,
    ) -> SharedStep | None:
        """Bind the step's dense (no gatherer), in-order caches to arena slots, if there are at least
        :data:`SHARED_BATCH_MIN` of them; the others (and stragglers, see :data:`STRAGGLER_LENGTH`) take
        the per-sequence path. The arena grows only while :meth:`kv_held_bytes` stays within ``kv_limit``
        (None: no limit); caches it has no room for take the per-sequence path on their own buffers
        until a slot frees. Drops an arena no cache is bound to any more."""
        members = [i for i, (g, o) in enumerate(zip(gatherers, ordered, strict=True)) if g is None and o]
        members = _without_stragglers([caches[i].length for i in members], members)
        if len(members) < SHARED_BATCH_MIN:
            if self.runtime.arena is not None and not self.runtime.arena.occupied():
                self.runtime.arena = None
            return None
        max_growth = None if kv_limit is None else kv_limit - self.runtime.kv_held_bytes()
        if self.runtime.arena is None:
            self.runtime.arena = DecodeArena(caches[members[0]])
        placed = self.runtime.arena.bind([caches[i] for i in members], max_growth)
        members = [i for i, slot in zip(members, placed, strict=True) if slot is not None]
        if len(members) < SHARED_BATCH_MIN:
            if not self.runtime.arena.occupied():
                self.runtime.arena = None
            return None
        slots = [slot for slot in placed if slot is not None]
        lo, hi = min(slots), max(slots) + 1
        lengths = [caches[i].own_length for i in members]
        longest = max(lengths)
        # A whole slot is one contiguous matrix per head, which the matmul reads without a copy: worth
        # reading up to a quarter more (padded) rows for.
        width = self.runtime.arena.capacity if 4 * self.runtime.arena.capacity <= 5 * longest else longest
        pick = torch.tensor(slots, device=self.runtime.device) - lo
        seen = torch.full((hi - lo,), width, dtype=torch.long, device=self.runtime.device)
        seen[pick] = torch.tensor(lengths, device=self.runtime.device)
        bias = None
        if any(length < width for length in lengths):  # host lengths: no device read
            bias = rows_past_bias(seen, width, self.runtime.compute_dtype).view(hi - lo, 1, 1, width)
        span = max(caches[i].position_span() for i in members)
        groups: dict[int, tuple[SharedPrefix, list[int], list[int]]] = {}
        for i, slot in zip(members, slots, strict=True):
            prefix = caches[i].prefix
            if prefix is not None:
                group = groups.setdefault(id(prefix), (prefix, [], []))
                group[1].append(slot - lo)
                group[2].append(caches[i].base)
        dtype = self.runtime.compute_dtype
        joined = None
        if groups:
            own_width = min(self.runtime.arena.capacity, round_up(longest, JOINED_WIDTH_BUCKET))
            joined_columns = sum(group[0].rows for group in groups.values()) + (hi - lo) * own_width
            one_query = max(group[0].rows for group in groups.values()) + own_width
            if joined_columns <= JOINED_COLUMNS_FACTOR * one_query:
                relative = [slot - lo for slot in slots]
                joined = JoinedRows.of(list(groups.values()), lengths, relative, own_width, dtype)
        return SharedStep(
            members=torch.tensor(members, device=self.runtime.device),
            member_list=members,
            slots=torch.tensor(slots, device=self.runtime.device),
            rows=torch.tensor([rows[i] - caches[i].base for i in members], device=self.runtime.device),
            lo=lo,
            hi=hi,
            pick=pick,
            width=width,
            bias=bias,
            span=span,
            slot_order=slots == list(range(lo, hi)),
            everyone=members == list(range(len(caches))),
            prefixes=()  # the joined form reads the prefixes itself
            if joined is not None
            else tuple(PrefixGroup.of(*group, hi - lo, dtype) for group in groups.values()),
            joined=joined,
        )

    def _shared_attention(
        self,
        shared: SharedStep,
        layer: int,
        q_rot: Tensor,
        k_pre: Tensor,
        k_rot: Tensor,
        v: Tensor,
        attend: bool,
    ) -> Tensor | None:
        """Write the members' new rows at ``layer`` (one indexed write per buffer) and, if ``attend``,
        return their attention [n, nh * d] in member order (one batched call over the arena's slots
        lo..hi). q_rot: [nh, B, d]; k_pre, k_rot, v: [kvh, B, d]."""
        arena = self.runtime.arena
        assert arena is not None

        def rows_of(x: Tensor) -> Tensor:
            return (x if shared.everyone else x[:, shared.members]).transpose(0, 1)

        arena.write(layer, shared.slots, shared.rows, rows_of(k_pre), rows_of(k_rot), rows_of(v))
        if not attend:
            return None
        nh, _, d = q_rot.shape
        span = slice(shared.lo, shared.hi)
        queries = rows_of(q_rot) * self.runtime.adapter.scaling(layer)  # [n, nh, d]
        if not shared.slot_order:
            padded = queries.new_zeros(shared.hi - shared.lo, nh, d)
            padded[shared.pick] = queries
            queries = padded
        if shared.joined is not None:
            got = shared.joined.attend(queries, layer, arena.k_rot[layer][span], arena.v[layer][span])
            return got if shared.slot_order else got[shared.pick]
        width = slice(0, shared.width)
        keys, values = arena.k_rot[layer][span, :, width], arena.v[layer][span, :, width]
        if shared.prefixes:
            pieces = [group.piece(layer) for group in shared.prefixes]
            got = batched_decode_with_prefixes(queries, keys, values, shared.bias, pieces)
        else:
            got = batched_decode_attention(queries, keys, values, shared.bias)
        return got if shared.slot_order else got[shared.pick]


# A reader copies in a shared prefix whose rows it reads are at most this share of its own rows (a chat
# template's system prompt before a long prompt of its own): sharing it saves little memory, and attending
# over it as a second piece costs more than one piece over the copy (docs/benchmarks.md, "A short shared
# prefix is copied in").
SHORT_PREFIX_SHARE = 0.25


def _copies_prefix_in(cache: KVCache, gatherer: KeyGatherer | None) -> bool:
    """Whether a cache reading a shared prefix copies it in before a decode step (False without one): a
    sparse decoder reads whole buffers; a prefix no other sequence reads is faster as one piece; so is a
    short one."""
    prefix = cache.prefix
    if prefix is None:
        return False
    if gatherer is not None or not prefix.held_by_others(cache):
        return True
    return cache.base <= SHORT_PREFIX_SHARE * cache.own_length


PAST_EVERY_POSITION = 1 << 40  # the position given to rows read past a cache's length (later than any query)


def padded_positions(k_pos: Tensor, rows: int) -> Tensor:
    """Key positions [T] extended to ``rows`` with :data:`PAST_EVERY_POSITION` (so a causal mask hides
    the rows past the valid ones and the positions stay in order)."""
    extra = rows - k_pos.shape[0]
    if extra <= 0:
        return k_pos
    return torch.cat((k_pos, k_pos.new_full((extra,), PAST_EVERY_POSITION)))


# A pass whose rows change from layer to layer (a blend's or share's recompute) sets ``bucket_rows``: where
# the projections are packed oneDNN matmuls (CPU bf16 / fp16), their inputs are padded with zero rows to a
# multiple of this many rows (the outputs of the real rows are sliced back). oneDNN builds a kernel for
# each new row count on its first use (about a millisecond for each projection), so a first recompute
# whose per-layer row counts were never seen paid for dozens of them; padded, the counts come from a small
# set that earlier requests already built. Row-wise operations only: padding changes no real row's rows.
ROW_BUCKET = 32


def _padded_rows(x: Tensor, bucket: bool) -> Tensor:
    """``x`` [R, ...] with zero rows appended up to a multiple of :data:`ROW_BUCKET` (``bucket`` and more than
    one bucket's worth of rows), else ``x``."""
    rows = x.shape[0]
    if not bucket or rows <= ROW_BUCKET or rows % ROW_BUCKET == 0:
        return x
    padded = x.new_zeros((round_up(rows, ROW_BUCKET), *x.shape[1:]))
    padded[:rows] = x
    return padded


def _without_stragglers(lengths: list[int], members: list[int]) -> list[int]:
    """``members`` (indices, ``lengths[j]`` the cache length of ``members[j]``) without those longer than
    :data:`STRAGGLER_LENGTH` times the upper median length."""
    if not members:
        return members
    median = sorted(lengths)[len(lengths) // 2]
    return [i for i, n in zip(members, lengths, strict=True) if n <= STRAGGLER_LENGTH * median]
