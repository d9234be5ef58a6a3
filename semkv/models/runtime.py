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

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from semkv.models.adapters import LlamaFamilyAdapter, apply_rope
from semkv.models.cache import KVCache


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

    queries: [nh, A, d] pre-RoPE queries of the active rows; cos, sin: [A, d] their rotary tables
    (:meth:`rotated_queries` applies them on demand); q_pos: [A] their positions.
    keys: [kvh, T, d] rotated keys of every cache row at this layer (the active rows' fresh keys
    already written); k_pos: [T]. first_row: the cache row of offset 0 (``forward_rows``' start).
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

    def rotated_queries(self) -> Tensor:
        """[nh, A, d] the active rows' queries at their positions."""
        return apply_rope(self.queries, self.cos, self.sin)


class KeyGatherer(Protocol):
    """Supplies, per layer of a decode step, the keys to attend to (e.g. from a fast tier)."""

    def gather(self, layer: int, q_rot: Tensor, cache: KVCache) -> tuple[Tensor, Tensor, Tensor] | None:
        """q_rot: [nh, 1, d]. Return (keys [kvh, R, d] rotated, values [kvh, R, d], positions [R]),
        the new token's own row included, or None for every row. Called after the new row is
        written at this layer."""
        ...


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scaling: float,
    window: int | None = None,
    causal_prefix: bool = False,
) -> Tensor:
    """Scaled dot-product attention with a mask from absolute positions.

    q: [nh, Tq, d]; k, v: [kvh, Tk, d] (kvh divides nh); q_pos [Tq]; k_pos [Tk].
    causal_prefix: the caller guarantees q and k are the same rows at positions
    0..T-1 in order, so the fused causal kernel is exact.
    Returns [Tq, nh * d].
    """
    gqa = q.shape[0] != k.shape[0]
    # 4-D inputs (a batch of one): on CPU only these reach the fused flash kernel; 3-D inputs fall
    # back to the math path, which materialises the whole score matrix (~5x slower at 1K tokens).
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if causal_prefix and (window is None or q.shape[1] <= window):
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scaling, enable_gqa=gqa)
    elif _splittable(q, k, q_pos, k_pos, window):
        if _is_suffix(q_pos, k_pos):
            return _suffix_attention(q, k, v, scaling)
        return _split_attention(q, k, v, q_pos, k_pos, scaling)
    else:
        out = torch.cat(
            [
                _masked_attention(
                    q4[:, :, qs], k4[:, :, ks], v4[:, :, ks], q_pos[qs], k_pos[ks], scaling, window, gqa
                )
                for qs, ks in _query_groups(q_pos, k_pos, window)
            ],
            dim=2,
        )
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


QUERY_GROUP_ROWS = 128  # smallest query group worth its own kernel call
QUERY_GROUPS = 8


def _in_order(positions: Tensor) -> bool:
    """Positions [T] never decrease."""
    return not bool((positions[1:] < positions[:-1]).any())


def _query_groups(q_pos: Tensor, k_pos: Tensor, window: int | None) -> list[tuple[slice, slice]]:
    """Split queries into position-ordered groups, each with the only key range it can see.

    A masked kernel computes every (query, key) pair, masked or not; when queries and keys are
    both in position order, group g only needs keys up to its last query's position (and, with a
    window, from its first query's window start), so a long masked prefill costs about what a
    causal one does. The result is the same attention: only fully masked keys are left out.
    """
    tq = q_pos.shape[0]
    whole = [(slice(0, tq), slice(0, k_pos.shape[0]))]
    if tq < 2 * QUERY_GROUP_ROWS or k_pos.shape[0] < 2 * QUERY_GROUP_ROWS:
        return whole
    if not (_in_order(q_pos) and _in_order(k_pos)):
        return whole
    groups = min(QUERY_GROUPS, tq // QUERY_GROUP_ROWS)
    bounds = [round(i * tq / groups) for i in range(groups + 1)]
    firsts = q_pos[bounds[:-1]]
    lasts = q_pos[[b - 1 for b in bounds[1:]]]
    his = torch.searchsorted(k_pos, lasts, right=True).tolist()
    if window is None:
        los = [0] * groups
    else:
        los = torch.searchsorted(k_pos, firsts - window + 1).tolist()
    return [(slice(bounds[i], bounds[i + 1]), slice(los[i], his[i])) for i in range(groups)]


def _masked_attention(
    q4: Tensor,
    k4: Tensor,
    v4: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scaling: float,
    window: int | None,
    gqa: bool,
) -> Tensor:
    """SDPA over [1, heads, T, d] inputs with the mask from positions; returns [1, nh, Tq, d]."""
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        mask &= (q_pos.unsqueeze(1) - k_pos.unsqueeze(0)) < window
    if bool(mask.all()):
        mask = None
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scaling, enable_gqa=gqa)


SPLIT_QUERY_ROWS = 64  # queries per group of the split kernel (measured best at 4K keys: 44-64)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _splittable(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, window: int | None) -> bool:
    """The split kernel applies on CPU, without a window, to many queries and keys in position order."""
    return (
        _FLASH_CPU is not None
        and q.device.type == "cpu"
        and window is None
        and q.shape[1] >= 2 * SPLIT_QUERY_ROWS
        and q.shape[0] % k.shape[0] == 0
        and _in_order(q_pos)
        and _in_order(k_pos)
    )


def _split_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scaling: float) -> Tensor:
    """Attention of scattered queries in position order: per group of queries, the keys every
    query of the group sees go through the unmasked kernel and only the band of keys between
    the group's first and last position through a masked one; the two are merged by their
    log-sum-exp. The masked kernel costs ~2x the unmasked one per (query, key) pair on CPU, and
    this keeps masked pairs to ~1/groups of the work (selective recompute: ~1.3x faster).

    q: [nh, Tq, d]; k, v: [kvh, Tk, d]. Returns [Tq, nh * d].
    """
    nh, tq, d = q.shape
    groups = -(-tq // SPLIT_QUERY_ROWS)
    bounds = [round(i * tq / groups) for i in range(groups + 1)]
    firsts = q_pos[bounds[:-1]]
    lasts = q_pos[[b - 1 for b in bounds[1:]]]
    los = torch.searchsorted(k_pos, firsts).tolist()
    his = torch.searchsorted(k_pos, lasts, right=True).tolist()
    out = q.new_empty(nh, tq, d)
    for a, b, lo, hi in zip(bounds[:-1], bounds[1:], los, his, strict=True):
        rows = q[:, a:b]
        visible = k_pos[lo:hi].unsqueeze(0) <= q_pos[a:b].unsqueeze(1)  # [n, hi - lo]
        bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill_(~visible, float("-inf"))
        band, band_lse = _folded_attention(rows, k[:, lo:hi], v[:, lo:hi], scaling, bias)
        if lo > 0:
            # A row that sees no key of the band comes back as output 0 with lse 0: give it lse -inf.
            band_lse.masked_fill_(~visible.any(1), float("-inf"))
            seen, seen_lse = _folded_attention(rows, k[:, :lo], v[:, :lo], scaling)
            band = _merge(seen, seen_lse, band, band_lse)
        out[:, a:b] = band[0]
    return out.transpose(0, 1).reshape(tq, -1)


def _folded_attention(
    q: Tensor, k: Tensor, v: Tensor, scaling: float, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The CPU flash kernel with query heads folded onto their KV head ([1, kvh, rep * n, d]), so each
    key block is read once per KV head. q: [nh, n, d]; k, v: [kvh, S, d]; bias: [n, S] additive mask
    or None. Returns out [1, nh, n, d] and its log-sum-exp [1, nh, n]."""
    nh, n, d = q.shape
    kvh = k.shape[0]
    rep = nh // kvh
    mask = None if bias is None else bias.repeat(rep, 1)
    out, lse = _FLASH_CPU(
        q.reshape(1, kvh, rep * n, d), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scaling
    )[:2]
    return out.reshape(1, nh, n, d), lse.reshape(1, nh, n)


def _is_suffix(q_pos: Tensor, k_pos: Tensor) -> bool:
    """The queries are the last keys, in order (a prefill after reused rows, e.g. prefix reuse)."""
    tq = q_pos.shape[0]
    return tq <= k_pos.shape[0] and bool((k_pos[-tq:] == q_pos).all())


def _suffix_attention(q: Tensor, k: Tensor, v: Tensor, scaling: float) -> Tensor:
    """Queries that are the last Tq of the keys: the earlier keys through the unmasked kernel
    and the square block through the causal one, merged
    by log-sum-exp; no masked kernel at all. q: [nh, Tq, d]; k, v: [kvh, Tk, d] -> [Tq, nh * d]."""
    nh, tq, d = q.shape
    kvh, tk = k.shape[0], k.shape[1]
    rep = nh // kvh
    own_k = k[:, tk - tq :].repeat_interleave(rep, 0).unsqueeze(0)
    own_v = v[:, tk - tq :].repeat_interleave(rep, 0).unsqueeze(0)
    out, lse = _FLASH_CPU(q.unsqueeze(0), own_k, own_v, is_causal=True, scale=scaling)[:2]
    if tk > tq:
        seen, seen_lse = _folded_attention(q, k[:, : tk - tq], v[:, : tk - tq], scaling)
        out = _merge(seen, seen_lse, out, lse)
    return out[0].transpose(0, 1).reshape(tq, -1)


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Combine two attentions over disjoint key sets: out [1, h, n, d], lse [1, h, n] (-inf where a
    row saw no key of that part, whose output then gets weight 0)."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top).unsqueeze(-1), torch.exp(lse_b - top).unsqueeze(-1)
    return (out_a * w_a + out_b * w_b) / (w_a + w_b)


class RopeTables:
    """cos/sin [T, d] of fixed positions, computed once per rotary group of layers (not once per layer)."""

    def __init__(self, adapter: LlamaFamilyAdapter, positions: Tensor, like: Tensor) -> None:
        self.adapter, self.positions, self.like = adapter, positions, like
        self.tables: dict[str, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer: int) -> tuple[Tensor, Tensor]:
        group = self.adapter.rope_group(layer)
        if group not in self.tables:
            self.tables[group] = self.adapter.rotary(self.positions, layer, self.like)
        return self.tables[group]


class Runtime:
    """Prefill and decode over one model through its family adapter (batch of one sequence)."""

    def __init__(
        self,
        adapter: LlamaFamilyAdapter,
        kv_dtype: torch.dtype,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.adapter = adapter
        self.kv_dtype = kv_dtype
        self.compute_dtype = compute_dtype
        self.device = next(adapter.hf_model.parameters()).device

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    def new_cache(self, capacity: int) -> KVCache:
        a = self.adapter
        return KVCache(
            a.num_layers, a.num_kv_heads, a.head_dim, capacity, self.kv_dtype, self.compute_dtype, self.device
        )

    def rope(self, k_pre: Tensor, positions: Tensor, layer: int) -> Tensor:
        """Rotate pre-RoPE keys [heads, T, d] to ``positions`` [T] with ``layer``'s rotary table."""
        k = k_pre.to(self.compute_dtype)
        cos, sin = self.adapter.rotary(positions, layer, k)
        return apply_rope(k, cos, sin)

    # -- loading reused KV ----------------------------------------------------------------------
    def load_rows(
        self, cache: KVCache, k_pre: Tensor, v: Tensor, positions: Tensor, token_ids: list[int]
    ) -> int:
        """Append rows holding reused KV, re-rotated to ``positions``.

        k_pre, v: [L, kvh, n, d] (any float dtype; rounded to the KV dtype); positions [n].
        Re-applying RoPE to stored pre-RoPE keys is exact, not an approximation.
        Returns the first appended row.
        """
        start = cache.append_rows(positions.to(cache.device), token_ids)
        rows = slice(start, start + positions.shape[0])
        tables = RopeTables(
            self.adapter, positions.to(cache.device), torch.empty(0, dtype=self.compute_dtype)
        )
        for layer in range(self.num_layers):
            kp = k_pre[layer].to(self.kv_dtype)
            cache.write(layer, rows, kp, apply_rope(kp.to(self.compute_dtype), *tables(layer)), v[layer])
        return start

    # -- the layer loop ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_rows(self, cache: KVCache, start: int, selector: RecomputeSelector | None = None) -> Tensor:
        """Run every layer over cache rows [start, length); return the last row's logits [V].

        Without a selector every row is computed at every layer (plain prefill). With
        one, the rows are assumed pre-loaded with reused KV and the selector decides,
        per layer, which rows keep being recomputed. The last row must stay selected.
        If the cache has a ``query_observer`` it is called at every layer with the rotated
        queries [nh, A, d] of the rows computed there and their positions [A] (SnapKV/H2O capture).
        """
        a = self.adapter
        count = cache.length - start
        if count <= 0:
            raise ValueError("forward_rows needs at least one row to compute")
        positions = cache.positions[start : cache.length]
        token_ids = torch.tensor(cache.token_ids[start : cache.length], dtype=torch.long, device=self.device)
        hidden = a.embed(token_ids).to(self.compute_dtype)
        active = torch.arange(count, device=self.device)
        tables = RopeTables(a, positions, hidden)
        fresh_prefix = (
            start == 0
            and selector is None
            and bool((positions == torch.arange(count, device=self.device)).all())
        )
        observer = cache.query_observer
        attend = getattr(selector, "attention", None) or attention
        for layer in range(a.num_layers):
            q, k, v = a.qkv(layer, hidden)
            rows = active + start
            q_pos = positions[active]
            cos, sin = tables(layer)
            if active.numel() != count:
                cos, sin = cos[active], sin[active]
            if observer is not None:
                observer(layer, apply_rope(q, cos, sin), q_pos)
            k_pre = k.to(self.kv_dtype)
            k_rot = apply_rope(k_pre.to(self.compute_dtype), cos, sin)
            if selector is None:
                cache.write(layer, slice(start, cache.length), k_pre, k_rot, v)
            else:
                cached_k = cache.k_pre[layer][:, rows].to(self.compute_dtype)
                cached_v = cache.v[layer][:, rows].clone()
                cache.write(layer, rows, k_pre, k_rot, v)
                inputs = LayerInputs(
                    q,
                    cos,
                    sin,
                    q_pos,
                    cache.keys(layer),
                    cache.valid_positions(),
                    start,
                    a.scaling(layer),
                    a.window(layer),
                )
                keep = selector.select(
                    layer, active, k_pre.to(self.compute_dtype), v, cached_k, cached_v, inputs
                )
                if keep.numel() == 0 or int(active[keep[-1]]) != count - 1:
                    raise RuntimeError("a recompute selector must keep the last row")
                if keep.numel() != active.numel():
                    active, hidden, q, q_pos, cos, sin = (
                        active[keep],
                        hidden[keep],
                        q[:, keep],
                        q_pos[keep],
                        cos[keep],
                        sin[keep],
                    )
            if layer == a.num_layers - 1 and active.numel() > 1:
                # Only the last row's output matters after the last layer.
                active, hidden, q, q_pos, cos, sin = (
                    active[-1:],
                    hidden[-1:],
                    q[:, -1:],
                    q_pos[-1:],
                    cos[-1:],
                    sin[-1:],
                )
                fresh_prefix = False
            out = attend(
                apply_rope(q, cos, sin),
                cache.keys(layer),
                cache.values(layer),
                q_pos,
                cache.valid_positions(),
                a.scaling(layer),
                a.window(layer),
                causal_prefix=fresh_prefix,
            )
            hidden = a.finish_layer(layer, hidden, out)
        return a.logits(hidden[-1:])[0]

    def prefill(self, cache: KVCache, token_ids: list[int], positions: Tensor | None = None) -> Tensor:
        """Append ``token_ids`` at ``positions`` (default: right after the cache) and compute them.

        Returns the last token's logits [V].
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        if positions is None:
            first = int(cache.valid_positions().max()) + 1 if cache.length else 0
            positions = torch.arange(first, first + len(token_ids), device=self.device)
        start = cache.append_rows(positions, token_ids)
        return self.forward_rows(cache, start)

    @torch.inference_mode()
    def decode(self, cache: KVCache, token_id: int, gatherer: KeyGatherer | None = None) -> Tensor:
        """Append one token at the next position and return its logits [V].

        Without a ``gatherer`` each layer attends to every row; with one (a sparse decoder), to the
        keys, values and positions it hands over.
        """
        a = self.adapter
        position = int(cache.positions[cache.length - 1]) + 1 if cache.length else 0
        row = cache.append_rows(torch.tensor([position], device=self.device), [token_id])
        pos = cache.positions[row : row + 1]
        hidden = a.embed(torch.tensor([token_id], device=self.device)).to(self.compute_dtype)
        tables = RopeTables(a, pos, hidden)
        for layer in range(a.num_layers):
            q, k, v = a.qkv(layer, hidden)
            cos, sin = tables(layer)
            k_pre = k.to(self.kv_dtype)
            cache.write(
                layer, slice(row, row + 1), k_pre, apply_rope(k_pre.to(self.compute_dtype), cos, sin), v
            )
            q_rot = apply_rope(q, cos, sin)
            keys, values, k_pos = cache.keys(layer), cache.values(layer), cache.valid_positions()
            if gatherer is not None:
                picked = gatherer.gather(layer, q_rot, cache)
                if picked is not None:
                    keys, values, k_pos = picked
            out = attention(q_rot, keys, values, pos, k_pos, a.scaling(layer), a.window(layer))
            hidden = a.finish_layer(layer, hidden, out)
        return a.logits(hidden)[0]
