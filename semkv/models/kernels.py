"""Attention kernels with masks from absolute positions.

A query at position ``q`` sees a key at position ``p`` iff ``p <= q`` and, on sliding-window layers,
``q - p < window``. Masks are always built from positions, never from row order, so rows need not be
in position order and a scattered subset of queries never sees later keys.

Two families of kernels, chosen by the compute dtype:

* float32 (and any dtype off CPU): torch's fused kernels: the causal flash kernel for a fresh prefix,
  the split kernel (unmasked + band, merged by log-sum-exp) for scattered queries in position order,
  masked SDPA per query group otherwise;
* bfloat16 / float16 on CPU: :func:`gemm_attention`, batched matmuls over groups of queries. torch's
  CPU flash kernel gains nothing from bf16 (it computes in fp32) and its single-query path is slower in
  bf16 than in fp32, while bf16 matmuls run several times faster than fp32 ones on CPUs with
  AVX512-BF16, so blocked matmul attention is the faster kernel there, for prefill and decode alike.
  On CPUs with AMX tiles torch's flash kernel runs its bf16 products on them: there scattered rows (a
  blend's or share's recompute) on global layers go through it with a mask
  (:func:`scattered_flash_attention`), while a prefill's rows stay on the matmuls, which a prefix hit's
  tail must match, and window layers keep them too.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def uses_gemm_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Attention on ``device`` in ``dtype`` runs as this module's matmul kernels (:func:`gemm_attention`,
    :func:`decode_products`): CPU in bf16 / fp16. Elsewhere torch's scaled_dot_product_attention."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scaling: float,
    window: int | None = None,
    causal_prefix: bool = False,
    ordered: bool | None = None,
    plans: GemmPlans | None = None,
) -> Tensor:
    """Scaled dot-product attention with a mask from absolute positions.

    q: [nh, Tq, d]; k, v: [kvh, Tk, d] (kvh divides nh); q_pos [Tq]; k_pos [Tk].
    causal_prefix: the caller guarantees q and k are the same rows at positions
    0..T-1 in order, so the fused causal kernel is exact.
    ordered: queries and keys are known to be in position order (True) or not (False); None: check.
    plans: where :func:`gemm_attention` keeps its plans for reuse by the next layers of one forward.
    Returns [Tq, nh * d] in q's dtype. bf16 / fp16 on CPU go to :func:`gemm_attention`.
    """
    if uses_gemm_kernels(q.device, q.dtype):
        return gemm_attention(
            q, k, v, q_pos, k_pos, scaling, window, True if causal_prefix else ordered, plans
        )
    gqa = q.shape[0] != k.shape[0]
    # 4-D inputs (a batch of one): on CPU only these reach the fused flash kernel; 3-D inputs fall
    # back to the math path, which materialises the whole score matrix (much slower).
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


def in_order(positions: Tensor) -> bool:
    """Positions [T] never decrease."""
    return not bool((positions[1:] < positions[:-1]).any())


def visible_keys(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Bool [Tq, Tk]: query i (at ``q_pos[i]``) sees key j (at ``k_pos[j]``): not later, and within the
    window where there is one."""
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        visible &= (q_pos.unsqueeze(1) - k_pos.unsqueeze(0)) < window
    return visible


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
    if not (in_order(q_pos) and in_order(k_pos)):
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
    mask = visible_keys(q_pos, k_pos, window)
    if bool(mask.all()):
        mask = None
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scaling, enable_gqa=gqa)


SPLIT_QUERY_ROWS = 64  # queries per group of the split kernel (the best group size on CPU)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _splittable(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, window: int | None) -> bool:
    """The split kernel applies on CPU, without a window, to many queries and keys in position order."""
    return (
        _FLASH_CPU is not None
        and q.device.type == "cpu"
        and window is None
        and q.shape[1] >= 2 * SPLIT_QUERY_ROWS
        and q.shape[0] % k.shape[0] == 0
        and in_order(q_pos)
        and in_order(k_pos)
    )


def _split_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scaling: float) -> Tensor:
    """Attention of scattered queries in position order: per group of queries, the keys every
    query of the group sees go through the unmasked kernel and only the band of keys between
    the group's first and last position through a masked one; the two are merged by their
    log-sum-exp. The masked kernel costs more than the unmasked one per (query, key) pair on CPU, and
    this keeps masked pairs to ~1/groups of the work.

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
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~visible, float("-inf")
        )
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


GEMM_QUERY_ROWS = 64  # queries per group of the matmul kernel (scattered rows; the best size without AMX)
GEMM_WINDOW_SPAN = 1.0  # on window layers, a query group spans fewer positions than this x the window
GEMM_KEY_BUCKET = 64  # a group's key range is widened (masked) to a multiple of this many keys
GEMM_QUERY_BUCKET = 4  # a group's queries are computed as a multiple of at least this many (bucketed_rows)


def _has_amx() -> bool:
    """The CPU has AMX tiles (and torch can tell)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return amx is not None and bool(amx())
    except RuntimeError:  # a build that cannot ask the CPU
        return False


# The most queries a group of position-dense rows (a prefill) may hold: taller products run faster on CPUs
# with AMX tiles and on those with AVX512-BF16 alike, the only ones where the compute dtype is bf16 by
# default (docs/benchmarks.md, 'Taller query groups').
DENSE_QUERY_ROWS = 256
# Scattered rows (a blend's or share's recompute, not a prefill's suffix) on global layers go through
# torch's CPU flash kernel with a mask on CPUs with AMX tiles, where its bf16 products run on them and it
# beat these matmuls (docs/benchmarks.md, 'Scattered rows through the flash kernel'); elsewhere it was the
# slower kernel. Window layers keep the matmuls, whose query groups read ~2 windows of keys each where
# one masked call reads every key up to the last query (Gemma 3's blend was slower that way).
SCATTERED_ROWS_FLASH = _has_amx() and _FLASH_CPU is not None


def gemm_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scaling: float,
    window: int | None = None,
    ordered: bool | None = None,
    plans: GemmPlans | None = None,
) -> Tensor:
    """Attention as batched matmuls over groups of queries, for reduced-precision compute on CPU.

    Per group of :data:`GEMM_QUERY_ROWS` queries: scores = q @ k^T over the keys the group can see (a
    position range when queries and keys are in position order, else every key), a mask from positions
    added only on the columns some query of the group must not see (the causal band, the window's far
    edge), softmax (accumulated in fp32 by torch's CPU kernel, probabilities rounded to the compute
    dtype as in flash kernels), then probabilities @ v. The query heads of one KV head are folded into
    the rows of one matmul, so each key block is read once per KV head; one 2-D matmul per KV head
    (torch's CPU bf16 batched matmul copies strided operands, such as a key range of a cache buffer,
    first, which is slower); a group that reads every key of contiguous buffers takes one batched matmul
    over the KV heads instead (:func:`_all_keys_group`: nothing to copy, fewer calls).

    q: [nh, Tq, d]; k, v: [kvh, Tk, d]; q_pos [Tq]; k_pos [Tk]; ordered: queries and keys are known to
    be in position order (None: check); plans: reuse the plan (query groups, key ranges, masks) made for
    the same position tensors, window and dtype by an earlier layer (None: plan afresh). Returns
    [Tq, nh * d].
    """
    nh, tq, d = q.shape
    kvh = k.shape[0]
    rep = nh // kvh
    if tq > 1 and window is None and SCATTERED_ROWS_FLASH and not _one_run(q_pos):
        return scattered_flash_attention(q, k, v, q_pos, k_pos, scaling, window, ordered)
    q = q * scaling
    if tq == 1:
        if ordered is None:
            ordered = in_order(q_pos) and in_order(k_pos)
        return _gemm_decode(q, k, v, q_pos, k_pos, window, ordered)
    if plans is None:
        plan = GemmPlan.make(q_pos, k_pos, window, q.dtype, ordered)
    else:
        plan = plans.plan(q_pos, k_pos, window, q.dtype, ordered)
    # [kvh, Tq, rep, d]: a group's queries of one KV head are one contiguous [n * rep, d] matrix
    rows = q.view(kvh, rep, tq, d).transpose(1, 2).contiguous()
    out = q.new_empty(kvh, tq, rep, d)
    for a, b, lo, hi, biases in plan.groups:
        n, m = b - a, bucketed_rows(b - a)  # rows computed: the group's first
        group = _group_queries(rows, a, m)
        if lo == 0 and hi == k.shape[1] and k.is_contiguous() and v.is_contiguous():
            out[:, a:b] = _all_keys_group(group, k, v, n, biases)
            continue
        for h in range(kvh):
            scores = torch.mm(group[h].view(m * rep, d), k[h, lo:hi].t())  # [m * rep, hi - lo]
            grid = scores[: n * rep].view(n, rep, hi - lo)
            for c0, c1, bias in biases:
                grid[..., c0:c1] += bias.unsqueeze(1)
            softmax_rows(scores, n * rep)
            out[h, a:b] = torch.mm(scores, v[h, lo:hi])[: n * rep].view(n, rep, d)
    return out.transpose(0, 1).reshape(tq, nh * d)


def _one_run(q_pos: Tensor) -> bool:
    """The queries are consecutive positions in order (a prefill, or a piece of one after reused rows)."""
    return int(q_pos[-1] - q_pos[0]) == q_pos.shape[0] - 1 and in_order(q_pos)


def scattered_flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scaling: float,
    window: int | None = None,
    ordered: bool | None = None,
) -> Tensor:
    """Queries at scattered positions (not one run of positions) through torch's CPU flash kernel, one
    call with a boolean mask from positions [Tq, keys] shared by every head (GQA: each query head reads
    its KV head). In position order only the keys some query can see are passed: up to the last query,
    from the first query's window start. The kernel accumulates scores and sums in float32 and rounds
    once; a prefill's rows (one run) stay on :func:`gemm_attention`'s matmuls, so a prefix hit's tail
    computes what the full prefill computes. q: [nh, Tq, d]; k, v: [kvh, Tk, d]. Returns [Tq, nh * d]."""
    nh, tq, d = q.shape
    lo, hi = 0, k.shape[1]
    if ordered is None:
        ordered = in_order(q_pos) and in_order(k_pos)
    if ordered:
        hi = int(torch.searchsorted(k_pos, q_pos[-1:], right=True))
        if window is not None:
            lo = int(torch.searchsorted(k_pos, q_pos[:1] - window + 1))
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k[:, lo:hi].unsqueeze(0),
        v[:, lo:hi].unsqueeze(0),
        attn_mask=visible_keys(q_pos, k_pos[lo:hi], window),
        scale=scaling,
        enable_gqa=nh != k.shape[0],
    )
    return out[0].transpose(0, 1).reshape(tq, nh * d)


def _all_keys_group(
    group: Tensor, k: Tensor, v: Tensor, n: int, biases: list[tuple[int, int, Tensor]]
) -> Tensor:
    """One query group that reads every key of contiguous ``k``, ``v`` [kvh, Tk, d] (a prefix hit's tail,
    the last group of a prefill): two batched matmuls over the KV heads instead of two matmuls per head
    (whole contiguous operands: nothing for the batched kernel to copy first; a short tail is bound by
    per-call overhead). group: [kvh, m, rep, d] scaled queries, the first ``n`` real; biases: (first
    column, end column, [n, columns] additive mask) on the columns some query must not see. Returns
    [kvh, n, rep, d]."""
    kvh, m, rep, d = group.shape
    scores = torch.bmm(group.view(kvh, m * rep, d), k.transpose(1, 2))  # [kvh, m * rep, Tk]
    grid = scores[:, : n * rep].view(kvh, n, rep, k.shape[1])
    for c0, c1, bias in biases:
        grid[..., c0:c1] += bias.unsqueeze(1)
    if n == m:
        torch.softmax(scores, dim=-1, out=scores)
    else:  # each head's real rows are contiguous, their slice over all heads is not (softmax would copy)
        for head in scores:
            softmax_rows(head, n * rep)
    return torch.bmm(scores, v)[:, : n * rep].view(kvh, n, rep, d)


def softmax_rows(scores: Tensor, rows: int) -> None:
    """Softmax over the last dim of the first ``rows`` rows of ``scores`` [R, K], in place; the rows after
    them (a query group's padding: zero queries, so zero scores) are left as they are. A row's softmax
    does not depend on the other rows (the same bits as over the whole matrix), and the padding's rows
    cost as much as real ones (a prefix hit's short tail is mostly padding). The matmul after it keeps
    the padded row count (its kernel is compiled per shape)."""
    real = scores[:rows]
    torch.softmax(real, dim=-1, out=real)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def bucketed_rows(n: int) -> int:
    """The rows a query group of ``n`` queries is computed as: ``n`` rounded up to a multiple of an eighth
    of the next power of two (at least :data:`GEMM_QUERY_BUCKET`): 18 -> 20, 50 -> 56, 100 -> 112,
    200 -> 224. oneDNN builds a kernel per matmul shape, and a group's query count changes from request
    to request where rows are selected (blend, share) or a prompt ends, while bucketed counts repeat
    (4 per power of two, 20 up to 256 rows); the padding is fewer than 4 rows or a quarter of them,
    where a fixed multiple of 16 nearly doubled a prefix hit's short tail."""
    step = max(GEMM_QUERY_BUCKET, (1 << (n - 1).bit_length()) // 8)
    return round_up(n, step)


def _group_queries(rows: Tensor, first: int, count: int) -> Tensor:
    """Queries ``first`` .. ``first + count`` of ``rows`` [kvh, Tq, rep, d] -> [kvh, count, rep, d], zeros
    past the last query (a copy only then).

    A group of n queries is computed as its first m = :func:`bucketed_rows` (n) rows (the rows after it,
    or zeros, computed and dropped). Each output row of a matmul depends only on its own row.
    """
    group = rows[:, first : first + count]
    extra = count - group.shape[1]
    if extra <= 0:
        return group
    return torch.cat((group, group.new_zeros((group.shape[0], extra, *group.shape[2:]))), dim=1)


@dataclass(frozen=True)
class GemmPlan:
    """What :func:`gemm_attention` works out from positions alone, before any matmul: per query group, its
    rows [a, b), the key range [lo, hi) it reads and the masks (column range within [lo, hi), additive
    bias [b - a, c1 - c0] of 0 / -inf) it adds. The same for every layer with the same window."""

    groups: list[tuple[int, int, int, int, list[tuple[int, int, Tensor]]]]

    @staticmethod
    def make(
        q_pos: Tensor, k_pos: Tensor, window: int | None, dtype: torch.dtype, ordered: bool | None
    ) -> GemmPlan:
        if ordered is None:
            ordered = in_order(q_pos) and in_order(k_pos)
        starts, ends = gemm_query_groups(q_pos, window, ordered)
        pieces = _gemm_pieces(q_pos, k_pos, window, ordered, starts, ends)
        groups = []
        for a, b, (lo, hi, masked) in zip(starts, ends, pieces, strict=True):
            biases = [
                (c0 - lo, c1 - lo, _position_bias(q_pos[a:b], k_pos[c0:c1], window, dtype))
                for c0, c1 in masked
            ]
            groups.append((a, b, lo, hi, biases))
        return GemmPlan(groups)


class GemmPlans:
    """:class:`GemmPlan` s of one forward, kept for the layers after the first that need them: every layer
    attends the same query rows over the same keys (per window size), so the plan (not free for a blend's
    hundreds of scattered rows) is made once.

    A plan is found again only for the very same ``q_pos`` and ``k_pos`` tensor objects: it is keyed by
    their ids and holds them, so no other tensor can take those ids while it lives. The caller must not
    change their values in place while this object lives.
    """

    def __init__(self) -> None:
        self._plans: dict[
            tuple[int, int, int | None, torch.dtype, bool | None], tuple[Tensor, Tensor, GemmPlan]
        ] = {}

    def plan(
        self, q_pos: Tensor, k_pos: Tensor, window: int | None, dtype: torch.dtype, ordered: bool | None
    ) -> GemmPlan:
        key = (id(q_pos), id(k_pos), window, dtype, ordered)
        if key not in self._plans:
            self._plans[key] = (q_pos, k_pos, GemmPlan.make(q_pos, k_pos, window, dtype, ordered))
        return self._plans[key][2]


def gemm_query_groups(
    q_pos: Tensor, window: int | None, ordered: bool, dense_rows: int | None = None
) -> tuple[list[int], list[int]]:
    """Query groups [starts[i], ends[i]): :data:`GEMM_QUERY_ROWS` queries each, or, for queries in position
    order, up to ``dense_rows`` (default :data:`DENSE_QUERY_ROWS`) while the group's positions span fewer
    than that many: a prefill's contiguous rows form taller groups (fewer, taller matmuls), while scattered
    rows (a blend's or share's recompute) keep groups of :data:`GEMM_QUERY_ROWS`, whose key ranges (up to
    each group's last query) would otherwise widen with the span. On a window layer a group also ends
    before a query :data:`GEMM_WINDOW_SPAN` x window positions past its first: a group reads keys from its
    first query's window start to its last query, so scattered queries (a blend's probe: the template and
    question rows over the whole prompt) would otherwise read every key on every window layer."""
    tq = q_pos.shape[0]
    dense = DENSE_QUERY_ROWS if dense_rows is None else dense_rows
    if not ordered or (window is None and dense <= GEMM_QUERY_ROWS):
        starts = list(range(0, tq, GEMM_QUERY_ROWS))
        return starts, [*starts[1:], tq]
    positions = q_pos.tolist()
    span = None if window is None else max(1, int(GEMM_WINDOW_SPAN * window))
    starts, ends = [], []
    first = 0
    while first < tq:
        end = min(tq, first + GEMM_QUERY_ROWS)
        if dense > GEMM_QUERY_ROWS:
            taller = bisect.bisect_left(positions, positions[first] + dense, first, min(tq, first + dense))
            end = max(end, taller)
        if span is not None:
            end = min(end, bisect.bisect_left(positions, positions[first] + span, first))
        starts.append(first)
        ends.append(max(end, first + 1))
        first = ends[-1]
    return starts, ends


def _gemm_pieces(
    q_pos: Tensor, k_pos: Tensor, window: int | None, ordered: bool, starts: list[int], ends: list[int]
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Per query group: (lo, hi, masked column ranges) of the keys it attends over.

    In position order, keys before ``lo`` are out of every query's window and keys from ``hi`` on are
    later than every query; inside, only columns after the group's first query (causal band) and
    before its last query's window start need a mask. Unordered: every key, every column masked.
    """
    tk = k_pos.shape[0]
    if not ordered:
        return [(0, tk, [(0, tk)]) for _ in starts]
    firsts, lasts = q_pos[starts], q_pos[[e - 1 for e in ends]]
    his = torch.searchsorted(k_pos, lasts, right=True).tolist()
    seen_by_all = torch.searchsorted(k_pos, firsts, right=True).tolist()  # keys <= every query's position
    if window is None:
        los, inside = [0] * len(starts), [0] * len(starts)
    else:
        los = torch.searchsorted(k_pos, firsts - window + 1).tolist()
        inside = torch.searchsorted(k_pos, lasts - window + 1).tolist()  # in every query's window from here
    pieces = []
    for lo, hi, full, win in zip(los, his, seen_by_all, inside, strict=True):
        m0 = min(max(win, lo), hi)
        m1 = min(max(full, m0), hi)
        lo, hi = _bucketed(lo, hi, tk)  # the widening is masked: keys past hi are later than every query
        pieces.append((lo, hi, [(c0, c1) for c0, c1 in ((lo, m0), (m1, hi)) if c1 > c0]))
    return pieces


def _bucketed(lo: int, hi: int, tk: int) -> tuple[int, int]:
    """The key range [lo, hi) of ``tk`` keys widened to a multiple of :data:`GEMM_KEY_BUCKET` keys (past
    hi first, then before lo; at most every key). oneDNN compiles a matmul kernel for every new shape (on
    AMX CPUs several times the product itself: docs/benchmarks.md, share): scattered rows (a blend's or
    share's recompute) read a new number of keys for nearly every group of every request, while bucketed
    widths repeat across requests and come from its cache. A group that ends at the last key is widened
    past it only when the caller hands over keys past the valid ones, at positions past every query (see
    ``Runtime.attended_rows``)."""
    width = min(tk, round_up(hi - lo, GEMM_KEY_BUCKET))
    hi = min(tk, lo + width)
    return hi - width, hi


def _position_bias(q_pos: Tensor, k_pos: Tensor, window: int | None, dtype: torch.dtype) -> Tensor:
    """Additive mask [n, m]: 0 where query i sees key j, -inf elsewhere."""
    hidden = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)
    if window is not None:
        hidden |= (q_pos.unsqueeze(1) - k_pos.unsqueeze(0)) >= window
    return torch.zeros(hidden.shape, dtype=dtype, device=q_pos.device).masked_fill_(hidden, float("-inf"))


def _gemm_decode(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, window: int | None, ordered: bool
) -> Tensor:
    """One (already scaled) query [nh, 1, d] over keys [kvh, Tk, d] -> [1, nh * d].

    Scores are formed as k @ q^T over the cache's key range as it is. Copying the key and value ranges
    contiguous first is slightly faster at short contexts but much slower at long ones (likely the fresh
    multi-MB buffer per layer and step).
    """
    lo, hi = 0, k.shape[1]
    if ordered:
        hi = int(torch.searchsorted(k_pos, q_pos, right=True))
        if window is not None:
            lo = int(torch.searchsorted(k_pos, q_pos - window + 1))
        bias = None
    else:
        bias = _position_bias(q_pos, k_pos, window, q.dtype)
        if not bool(torch.isinf(bias).any()):
            bias = None
    return decode_products(q, k[:, lo:hi], v[:, lo:hi], bias)


def decode_products(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """One already scaled query [nh, 1, d] over keys and values [kvh, R, d]: the scores of each KV head's
    query heads (folded into one matrix), ``bias`` [1, R] added (0 / -inf; None: every row seen),
    softmax, probabilities @ v. Returns [1, nh * d]. The tail of :func:`_gemm_decode`; a sparse
    decoder's gathered rows and a decode step over a cache's whole buffers come here directly with the
    mask built once per step.

    Contiguous keys give q @ k^T, whose scores come out contiguous; strided keys (a slice of a longer
    buffer, which torch's CPU batched matmul copies first either way) keep k @ q^T. The bias is added in
    place to contiguous scores: adding [1, R] to the transposed k @ q^T cost about as much as the
    product itself."""
    nh, _, d = q.shape
    kvh = k.shape[0]
    queries = q.view(kvh, nh // kvh, d)
    if k.is_contiguous():
        scores = torch.bmm(queries, k.transpose(1, 2))
    else:
        scores = torch.bmm(k, queries.transpose(1, 2)).transpose(1, 2)
        if bias is not None:
            scores = scores.contiguous()
    if bias is not None:
        scores += bias
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v).view(1, nh * d)


def batched_decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """One (already scaled) query per sequence over the caches of several sequences at once.

    q: [n, nh, d]; k, v: [n, kvh, W, d], sequence i's keys in row order, every row visible to its query
    except those ``bias`` masks (queries and keys in position order, no window cut: the caller's
    guarantee); in practice slots of a :class:`~semkv.models.cache.DecodeArena`, whose slot and head
    dimensions merge into one batch dimension without a copy. bias: [n, 1, 1, W] additive (0 / -inf),
    hiding the rows past each sequence's length, or None. Returns [n, nh * d].

    The same computation as :func:`_gemm_decode` (scores, softmax, probabilities @ values), in one
    batched matmul per product for all sequences. torch's CPU batched matmul copies a strided operand
    (rows of a slot past W) before multiplying unless it is the left one of k @ q^T, so keys go on the
    left when W is not the whole slot (several times faster there).
    """
    n, nh, d = q.shape
    kvh, width = k.shape[1], k.shape[2]
    rep = nh // kvh
    queries = q.reshape(n * kvh, rep, d)
    keys, values = k.flatten(0, 1), v.flatten(0, 1)  # views: a slot's heads are one stride apart
    scores = _slot_scores(queries, keys).view(n, kvh, rep, width)
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs.reshape(n * kvh, rep, width), values).view(n, nh * d)


def batched_decode_with_prefixes(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, prefixes: list[PrefixPiece]
) -> Tensor:
    """:func:`batched_decode_attention` for sequences whose first rows live in shared prefixes.

    q: [n, nh, d] (already scaled); k, v: [n, kvh, W, d] each sequence's own rows (after its prefix, if
    any), in row order; bias: [n, 1, 1, W] additive (0 / -inf) or None. prefixes: one
    :class:`PrefixPiece` per shared prefix: rows its members see before their own rows (each sequence
    in at most one). Queries and keys in position order, no window cut (the caller's guarantee).
    Returns [n, nh * d] in q's dtype.

    One softmax over both pieces: the scores of a prefix's members against its keys are one matmul for
    all of them (the prefix is read once per step, not once per sequence), placed before the own rows'
    scores; sequences without a prefix (or with a shorter one) see -inf there. A prefix reader's output
    (weights @ values over both pieces) is summed in float32 and rounded once, as a one-piece product
    is: a sum of two rounded low-precision halves moved greedy tokens of a tiny bf16 model away from
    the one-piece product's.
    """
    n, nh, d = q.shape
    kvh, width = k.shape[1], k.shape[2]
    rep = nh // kvh
    head = max((piece.keys.shape[1] for piece in prefixes), default=0)
    everyone = len(prefixes) == 1 and prefixes[0].members is None and prefixes[0].keys.shape[1] == head
    scores = (
        q.new_empty((n, kvh, rep, head + width))
        if everyone
        else q.new_full((n, kvh, rep, head + width), float("-inf"))
    )
    own = _slot_scores(q.reshape(n * kvh, rep, d), k.flatten(0, 1)).view(n, kvh, rep, width)
    scores[..., head:] = own if bias is None else own + bias
    for piece in prefixes:
        rows, picked = piece.keys.shape[1], piece.pick(q)
        count = picked.shape[0]
        grouped = picked.view(count, kvh, rep, d).transpose(0, 1).reshape(kvh, count * rep, d)
        # pool page views are strided across heads, which the batched matmul would copy transposed
        # (slower than this plain copy); scores come out contiguous, where the mask adds fast
        keys = piece.keys.contiguous()
        shared = torch.bmm(grouped, keys.transpose(1, 2)).view(kvh, count, rep, rows)
        if piece.bias is not None:
            shared += piece.bias.transpose(0, 1)
        piece.place(scores[..., :rows], shared.transpose(0, 1))
    probs = torch.softmax(scores, dim=-1)
    if everyone:
        out = q.new_empty((n, kvh, rep, d), dtype=torch.float32)
    else:  # sequences without a prefix: one product, as batched_decode_attention
        own_out = torch.bmm(probs[..., head:].reshape(n * kvh, rep, width), v.flatten(0, 1))
        out = own_out.view(n, kvh, rep, d).float()
    for piece in prefixes:
        rows, weights = piece.values.shape[1], piece.pick(probs)
        count = weights.shape[0]
        own_rows = weights[..., head:].reshape(count * kvh, rep, width).float()
        own_share = torch.bmm(own_rows, piece.pick(v).flatten(0, 1).float()).view(count, kvh, rep, d)
        prefix_rows = weights[..., :rows].transpose(0, 1).reshape(kvh, count * rep, rows).float()
        share = torch.bmm(prefix_rows, piece.values).view(kvh, count, rep, d).transpose(0, 1)
        piece.place(out, own_share + share)
    return out.view(n, nh * d).to(q.dtype)


def joined_decode_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """One (already scaled) query per sequence over one joined matrix of every sequence's key rows: the
    rows of shared prefixes once, then each sequence's own rows, a query seeing only its own (``bias``).

    q: [n, nh, d]; keys, values: [kvh, C, d] contiguous, in q's dtype; bias: [n, C] additive (0 / -inf),
    every row with at least one 0. Returns [n, nh * d].

    Two batched matmuls over the KV heads for the whole batch, the queries of all sequences stacked: the
    prefix rows are read once per step, and each query's output (probabilities @ values over its prefix
    rows and its own rows) is summed in float32 inside one product and rounded once, as a one-piece
    product over the query's rows is. The masked columns (other sequences' own rows) are the price: worth
    paying while they are few next to the prefix (the caller decides; docs/benchmarks.md, "Running
    sequences that share one pooled prompt").
    """
    n, nh, d = q.shape
    kvh, columns = keys.shape[0], keys.shape[1]
    rep = nh // kvh
    queries = q.view(n, kvh, rep, d).transpose(0, 1).reshape(kvh, n * rep, d)
    scores = torch.bmm(queries, keys.transpose(1, 2))  # [kvh, n * rep, C]
    scores.view(kvh, n, rep, columns).add_(bias.view(1, n, 1, columns))
    torch.softmax(scores, dim=-1, out=scores)
    out = torch.bmm(scores, values)  # [kvh, n * rep, d]
    return out.view(kvh, n, rep, d).transpose(0, 1).reshape(n, nh * d)


@dataclass(frozen=True)
class PrefixPiece:
    """One shared prefix in :func:`batched_decode_with_prefixes`: keys [kvh, P, d] (q's dtype) and values
    [kvh, P, d] (float32); members: [g] the sequences that read it (None: all of them, in order); bias:
    [g, 1, 1, P] additive (0 / -inf) hiding rows a member does not read (it reads only the first rows of
    a longer prefix), or None."""

    keys: Tensor
    values: Tensor
    members: Tensor | None = None
    bias: Tensor | None = None

    def pick(self, x: Tensor) -> Tensor:
        """The members' rows of ``x`` [n, ...]."""
        return x if self.members is None else x[self.members]

    def place(self, into: Tensor, rows: Tensor) -> None:
        """Write the members' ``rows`` [g, ...] into ``into`` [n, ...]."""
        if self.members is None:
            into.copy_(rows)
        else:
            into[self.members] = rows


def _slot_scores(queries: Tensor, keys: Tensor) -> Tensor:
    """queries [b, rep, d] @ keys [b, R, d]^T -> [b, rep, R]; strided keys go on the left (torch's CPU
    batched matmul copies a strided right operand first)."""
    if keys.is_contiguous():
        return torch.bmm(queries, keys.transpose(1, 2))
    return torch.bmm(keys, queries.transpose(1, 2)).transpose(1, 2)
