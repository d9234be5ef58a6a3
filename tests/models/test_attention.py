"""The attention kernels agree with a plain masked softmax on scattered positions (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from semkv.models.kernels import (
    GEMM_KEY_BUCKET,
    GEMM_QUERY_ROWS,
    SPLIT_QUERY_ROWS,
    GemmPlan,
    GemmPlans,
    attention,
    gemm_attention,
    gemm_query_groups,
    scattered_flash_attention,
)
from tests.tolerances import attention_atol


@pytest.fixture(autouse=True)
def matmul_kernel_for_scattered_rows(monkeypatch):
    """Scattered rows stay on the matmul kernel, whatever the CPU (on AMX CPUs they would go through the
    flash kernel: tested on its own below)."""
    import semkv.models.kernels as kernels

    monkeypatch.setattr(kernels, "SCATTERED_ROWS_FLASH", False)


def _fp32_tol(q, k, v, scaling) -> dict[str, float]:
    """What two fp32 attention kernels' summation orders may leave between their outputs
    (:func:`tests.tolerances.attention_atol`)."""
    return {"atol": attention_atol(q, k, v, scaling), "rtol": 0.0}


def reference(q, k, v, q_pos, k_pos, scaling, window=None):
    """Dense softmax over visible keys, per head; q [nh, Tq, d], k/v [kvh, Tk, d] -> [Tq, nh*d]."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        visible &= (q_pos.unsqueeze(1) - k_pos.unsqueeze(0)) < window
    scores = (q @ k.transpose(1, 2)) * scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(0, 1).reshape(q.shape[1], -1)


def _case(seed: int, num_keys: int, num_queries: int, step: int = 1):
    gen = torch.Generator().manual_seed(seed)
    k_pos = torch.arange(0, num_keys * step, step)
    picked = torch.randperm(num_keys - 1, generator=gen)[: num_queries - 1].sort().values
    q_pos = torch.cat([k_pos[picked], k_pos[-1:]])
    q = torch.randn(6, num_queries, 16, generator=gen)
    k = torch.randn(2, num_keys, 16, generator=gen)
    v = torch.randn(2, num_keys, 16, generator=gen)
    return q, k, v, q_pos, k_pos


@pytest.mark.parametrize("num_queries", [3, 2 * SPLIT_QUERY_ROWS, 5 * SPLIT_QUERY_ROWS + 7])
def test_scattered_queries_match_reference(num_queries):
    q, k, v, q_pos, k_pos = _case(0, 900, num_queries)
    scaling = 1 / math.sqrt(16)
    torch.testing.assert_close(
        attention(q, k, v, q_pos, k_pos, scaling),
        reference(q, k, v, q_pos, k_pos, scaling),
        **_fp32_tol(q, k, v, scaling),
    )


def test_queries_between_keys_match_reference():
    """Queries at odd positions over keys at even ones: the first query of a group can see no key of
    its group's band (a fully masked band row) and must take the keys before the band alone, not NaN."""
    q, k, v, _, k_pos = _case(1, 700, 3 * SPLIT_QUERY_ROWS)
    k_pos = torch.arange(0, 2 * 700, 2)
    q_pos = torch.arange(1, 2 * 3 * SPLIT_QUERY_ROWS, 2) * 3
    out = attention(q, k, v, q_pos, k_pos, 0.25)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference(q, k, v, q_pos, k_pos, 0.25), **_fp32_tol(q, k, v, 0.25))


def test_sliding_window_and_unsorted_positions_match_reference():
    q, k, v, q_pos, k_pos = _case(2, 600, 3 * SPLIT_QUERY_ROWS)
    torch.testing.assert_close(
        attention(q, k, v, q_pos, k_pos, 0.25, window=100),
        reference(q, k, v, q_pos, k_pos, 0.25, window=100),
        **_fp32_tol(q, k, v, 0.25),
    )
    order = torch.randperm(q_pos.shape[0], generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        attention(q[:, order], k, v, q_pos[order], k_pos, 0.25),
        reference(q[:, order], k, v, q_pos[order], k_pos, 0.25),
        **_fp32_tol(q, k, v, 0.25),
    )


@pytest.mark.parametrize("reused", [0, 37, 500])
def test_suffix_queries_match_reference(reused):
    """Queries that are the last keys (prefill after reused rows) take the unmasked + causal split."""
    gen = torch.Generator().manual_seed(4)
    num_queries = 3 * SPLIT_QUERY_ROWS
    k_pos = torch.arange(reused + num_queries)
    q_pos = k_pos[reused:]
    q = torch.randn(6, num_queries, 16, generator=gen)
    k, v = (
        torch.randn(2, k_pos.shape[0], 16, generator=gen),
        torch.randn(2, k_pos.shape[0], 16, generator=gen),
    )
    torch.testing.assert_close(
        attention(q, k, v, q_pos, k_pos, 0.25),
        reference(q, k, v, q_pos, k_pos, 0.25),
        **_fp32_tol(q, k, v, 0.25),
    )


@pytest.mark.parametrize("num_queries", [2 * SPLIT_QUERY_ROWS, 5 * SPLIT_QUERY_ROWS + 7])
def test_generic_path_without_the_cpu_kernel(num_queries, monkeypatch):
    """On a device without the CPU flash kernel (GPU, or a torch build lacking it) attention takes the
    generic SDPA path: same result on scattered and suffix queries."""
    import semkv.models.kernels as kernels

    q, k, v, q_pos, k_pos = _case(3, 700, num_queries)
    scaling = 1 / math.sqrt(16)
    fused = attention(q, k, v, q_pos, k_pos, scaling)
    tail = torch.arange(700 - num_queries, 700)
    fused_suffix = attention(q, k, v, tail, k_pos, scaling)
    monkeypatch.setattr(kernels, "_FLASH_CPU", None)
    assert not kernels._splittable(q, k, q_pos, k_pos, None)
    torch.testing.assert_close(
        attention(q, k, v, q_pos, k_pos, scaling), fused, **_fp32_tol(q, k, v, scaling)
    )
    torch.testing.assert_close(
        attention(q, k, v, tail, k_pos, scaling), fused_suffix, **_fp32_tol(q, k, v, scaling)
    )
    torch.testing.assert_close(
        fused, reference(q, k, v, q_pos, k_pos, scaling), **_fp32_tol(q, k, v, scaling)
    )


GEMM_CASES = {
    # name: (keys, queries, window, shuffle keys, queries at the end (suffix / decode))
    "scattered": (900, 5 * GEMM_QUERY_ROWS + 7, None, False, False),
    "scattered-window": (900, 3 * GEMM_QUERY_ROWS, 50, False, False),
    "sparse-window": (2000, 40, 100, False, False),  # a blend probe's rows: few, far apart
    "unsorted-window": (600, 2 * GEMM_QUERY_ROWS, 70, True, False),
    "causal-prefix": (3 * GEMM_QUERY_ROWS + 5, 3 * GEMM_QUERY_ROWS + 5, None, False, True),
    "suffix-window": (700, 2 * GEMM_QUERY_ROWS, 90, False, True),
    "decode": (800, 1, None, False, True),
    "decode-window": (800, 1, 64, False, True),
    "decode-unsorted": (800, 1, 64, True, True),
}


@pytest.mark.parametrize("name", sorted(GEMM_CASES))
def test_gemm_kernel_matches_reference(name):
    """The reduced-precision kernel (blocked matmuls, masks only on the band / window edge columns): exact
    in fp32 inputs, and within bf16 rounding through ``attention`` with bf16 inputs."""
    num_keys, num_queries, window, shuffle, at_end = GEMM_CASES[name]
    gen = torch.Generator().manual_seed(5)
    q, k, v, q_pos, k_pos = _case(5, num_keys, max(num_queries, 2))
    q = q[:, :num_queries]
    if at_end:
        q_pos = k_pos[num_keys - num_queries :]
    if shuffle:
        order = torch.randperm(num_keys, generator=gen)
        k, v, k_pos = k[:, order], v[:, order], k_pos[order]
    expected = reference(q, k, v, q_pos, k_pos, 0.25, window)
    got = gemm_attention(q, k, v, q_pos, k_pos, 0.25, window)
    torch.testing.assert_close(got, expected, **_fp32_tol(q, k, v, 0.25))
    low = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_pos, k_pos, 0.25, window)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, atol=3e-2, rtol=0)


def test_window_groups_bound_the_keys_read():
    """On a window layer, scattered queries in position order are grouped so that no group spans a window
    or more (each reads at most ~2 windows of keys, not every key); without a window, or out of order,
    groups are GEMM_QUERY_ROWS rows."""
    q_pos = torch.tensor([0, 5, 130, 140, 900, 901, 902, 1999])
    starts, ends = gemm_query_groups(q_pos, 100, True)
    assert list(zip(starts, ends, strict=True)) == [(0, 2), (2, 4), (4, 7), (7, 8)]
    assert gemm_query_groups(q_pos, None, True) == ([0], [8])
    assert gemm_query_groups(q_pos, 100, False) == ([0], [8])
    many = torch.arange(3 * GEMM_QUERY_ROWS)
    at_most = GEMM_QUERY_ROWS  # no taller groups (a CPU without AMX)
    assert gemm_query_groups(many, 10_000, True, at_most)[0] == [0, GEMM_QUERY_ROWS, 2 * GEMM_QUERY_ROWS]


def test_dense_rows_form_taller_groups_scattered_rows_do_not():
    """With taller groups allowed (``dense_rows``: AMX CPUs), a prefill's contiguous rows are grouped by
    ``dense_rows``; scattered rows keep groups of GEMM_QUERY_ROWS (a taller group of them would read keys
    up to a far later last query); a window still bounds a group's span; out of order, GEMM_QUERY_ROWS."""
    contiguous = torch.arange(600)
    assert gemm_query_groups(contiguous, None, True, 256) == ([0, 256, 512], [256, 512, 600])
    assert gemm_query_groups(contiguous, 100, True, 256)[0] == [0, 100, 200, 300, 400, 500]
    assert gemm_query_groups(contiguous, None, False, 256)[0] == list(range(0, 600, GEMM_QUERY_ROWS))
    scattered = torch.arange(0, 6000, 10)  # 600 rows, 10 positions apart
    starts, ends = gemm_query_groups(scattered, None, True, 256)
    assert max(b - a for a, b in zip(starts, ends, strict=True)) == GEMM_QUERY_ROWS
    half_dense = torch.cat((torch.arange(100), torch.arange(1000, 5000, 40)))  # 100 dense rows, then sparse
    assert gemm_query_groups(half_dense, None, True, 256)[1][0] == 100


@pytest.mark.parametrize("dense_rows", [GEMM_QUERY_ROWS, 256])
def test_taller_groups_give_the_reference_attention(monkeypatch, dense_rows):
    """A causal prefill, a suffix and a window layer's prefill computed in groups of ``dense_rows`` rows
    match the reference (fp32 inputs: within fp32 rounding of the kernel's sums)."""
    import semkv.models.kernels as kernels

    monkeypatch.setattr(kernels, "DENSE_QUERY_ROWS", dense_rows)
    for num_keys, num_queries, window in ((700, 700, None), (700, 300, None), (700, 700, 90)):
        q, k, v, q_pos, k_pos = _case(11, num_keys, num_queries)
        q_pos = k_pos[num_keys - num_queries :]
        got = gemm_attention(q, k, v, q_pos, k_pos, 0.25, window)
        torch.testing.assert_close(
            got, reference(q, k, v, q_pos, k_pos, 0.25, window), **_fp32_tol(q, k, v, 0.25)
        )


def test_gemm_plans_carry_over_layers_of_one_forward():
    """A plan is made once per (position tensors, window) and reused by the next layers: the outputs are
    bit-identical to planning afresh. Other position tensors with the same shape (a narrowed row set, a
    different layer's window) get their own plan, never a stale one: a memo keyed on shapes alone fails."""
    q, k, v, q_pos, k_pos = _case(7, 900, 3 * GEMM_QUERY_ROWS)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    plans = GemmPlans()
    for window in (50, None, 50, None):
        planned = attention(q, k, v, q_pos, k_pos, 0.25, window, plans=plans)
        assert torch.equal(planned, attention(q, k, v, q_pos, k_pos, 0.25, window))
    first = plans.plan(q_pos, k_pos, 50, torch.bfloat16, None)
    assert plans.plan(q_pos, k_pos, 50, torch.bfloat16, None) is first
    assert plans.plan(q_pos, k_pos, None, torch.bfloat16, None) is not first
    shifted = q_pos.clone()
    shifted[:-1] += 1  # same shape and dtype, other positions
    got = attention(q, k, v, shifted, k_pos, 0.25, 50, plans=plans)
    torch.testing.assert_close(
        got.float(), reference(q.float(), k.float(), v.float(), shifted, k_pos, 0.25, 50), atol=3e-2, rtol=0
    )
    assert plans.plan(shifted, k_pos, 50, torch.bfloat16, None) is not first


def test_window_key_ranges_come_in_buckets():
    """On a window layer, scattered rows of many prompts (a blend's recompute: new positions every request)
    read key ranges whose widths are multiples of GEMM_KEY_BUCKET (or every key), masked past the group's
    last query and before its window, so the matmul shapes repeat across requests and oneDNN's kernel
    cache serves them; the widened ranges still give the reference attention."""
    window = 300
    widths = set()
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        num_keys = 2000 + int(torch.randint(0, 200, (1,), generator=gen))
        q, k, v, q_pos, k_pos = _case(seed, num_keys, 150)
        plan = GemmPlan.make(q_pos, k_pos, window, torch.bfloat16, True)
        for a, b, lo, hi, _ in plan.groups:
            assert (hi - lo) % GEMM_KEY_BUCKET == 0 or hi - lo == num_keys, (lo, hi)
            assert lo <= int(torch.searchsorted(k_pos, q_pos[a] - window + 1))
            assert hi >= int(torch.searchsorted(k_pos, q_pos[b - 1], right=True))
            widths.add(hi - lo)
        if seed < 3:
            torch.testing.assert_close(
                gemm_attention(q, k, v, q_pos, k_pos, 0.25, window),
                reference(q, k, v, q_pos, k_pos, 0.25, window),
                **_fp32_tol(q, k, v, 0.25),
            )
    assert len(widths) <= 2200 // GEMM_KEY_BUCKET + 12  # without buckets: a new width for nearly every group


@pytest.mark.parametrize("tail", [3, 18, GEMM_QUERY_ROWS + 5])
def test_group_reading_every_key_batches_the_heads(monkeypatch, tail):
    """A prefix hit's tail (queries at the end of contiguous keys) is computed with one batched matmul
    over the KV heads per group that reads every key (the causal band masked by bias), matching the
    reference in fp32, and in bf16 the per-head matmuls it replaces (fed the same keys as a strided
    view, which keeps them) within bf16 rounding."""
    import semkv.models.kernels as kernels

    calls = []
    batched = kernels._all_keys_group
    monkeypatch.setattr(kernels, "_all_keys_group", lambda *a: calls.append(a[3]) or batched(*a))
    q, k, v, q_pos, k_pos = _case(13, 500, tail)
    q_pos = k_pos[-tail:]
    got = gemm_attention(q, k, v, q_pos, k_pos, 0.25)
    torch.testing.assert_close(got, reference(q, k, v, q_pos, k_pos, 0.25), **_fp32_tol(q, k, v, 0.25))
    assert calls and sum(calls) <= tail  # the last group (or all of a short tail) took the batched path
    low = [t.bfloat16() for t in (q, k, v)]
    wide_k = torch.cat((low[1], low[1]), dim=2)[..., :16]  # the same keys, not contiguous
    wide_v = torch.cat((low[2], low[2]), dim=2)[..., :16]
    calls.clear()
    per_head = gemm_attention(low[0], wide_k, wide_v, q_pos, k_pos, 0.25)
    assert not calls
    both = gemm_attention(*low, q_pos, k_pos, 0.25)
    torch.testing.assert_close(both.float(), per_head.float(), atol=2 * 2**-8, rtol=2**-7)


def _scattered_case(seed: int, shuffle: bool):
    """150 scattered queries over 700 keys (:func:`_case`), the keys shuffled out of position order if
    ``shuffle``."""
    q, k, v, q_pos, k_pos = _case(seed, 700, 150)
    if shuffle:
        order = torch.randperm(700, generator=torch.Generator().manual_seed(seed))
        k, v, k_pos = k[:, order], v[:, order], k_pos[order]
    return q, k, v, q_pos, k_pos


@pytest.mark.parametrize("shuffle", [False, True])
def test_scattered_rows_go_through_the_flash_kernel_where_chosen(monkeypatch, shuffle):
    """With SCATTERED_ROWS_FLASH (AMX CPUs), scattered bf16 queries (a recompute's rows; in order or not)
    on a global layer go through the flash kernel with a mask from positions and match the reference
    within bf16 rounding; a run of consecutive rows (a prefill, a prefix hit's tail) stays on the matmuls,
    which a hit's tail must share with the full prefill, and so does a window layer."""
    import semkv.models.kernels as kernels

    monkeypatch.setattr(kernels, "SCATTERED_ROWS_FLASH", True)
    calls = []
    flash = kernels.scattered_flash_attention
    monkeypatch.setattr(kernels, "scattered_flash_attention", lambda *a: calls.append(1) or flash(*a))
    q, k, v, q_pos, k_pos = _scattered_case(17, shuffle)
    low = [t.bfloat16() for t in (q, k, v)]
    got = attention(*low, q_pos, k_pos, 0.25)
    assert calls == [1]
    torch.testing.assert_close(got.float(), reference(q, k, v, q_pos, k_pos, 0.25), atol=3e-2, rtol=0)
    attention(*low, q_pos, k_pos, 0.25, 90)
    tail = k_pos.sort().values[-40:]
    attention(low[0][:, :40], low[1], low[2], tail, k_pos, 0.25)
    assert calls == [1]  # a window layer, consecutive rows: the matmul kernel


@pytest.mark.parametrize("window, shuffle", [(None, False), (90, False), (None, True), (90, True)])
def test_scattered_flash_attention_matches_the_reference(window, shuffle):
    """The flash path on its own: scattered queries, keys in position order or shuffled, with or without a
    window (its mask from positions), within bf16 rounding of the reference."""
    q, k, v, q_pos, k_pos = _scattered_case(19, shuffle)
    low = [t.bfloat16() for t in (q, k, v)]
    got = scattered_flash_attention(*low, q_pos, k_pos, 0.25, window)
    torch.testing.assert_close(got.float(), reference(q, k, v, q_pos, k_pos, 0.25, window), atol=3e-2, rtol=0)
