"""The matmul attention kernel runs in bucketed shapes, and the padding changes no result.

oneDNN builds a kernel for every new matmul shape (1-5 ms each on AMX CPUs, several times the product
itself), so a forward whose query groups and key ranges take a new size per prompt pays for dozens of
kernels on a first request. :func:`gemm_attention` widens key ranges to multiples of ``GEMM_KEY_BUCKET``
(masked), computes a query group as :func:`bucketed_rows` rows (the extra rows dropped), and a
forward hands it keys past the cache's valid rows (:meth:`Runtime.attended_rows`, positions past every
query from :func:`padded_positions`).

Injected: (1) keys past the valid rows holding large stale values (as a truncation leaves them) and
positions from ``padded_positions``, for in-order, scattered and sliding-window queries, in groups whose
sizes are not multiples of the query bucket; (2) bf16 prefills of a tiny llama on two prompt lengths that
share a key and a query bucket, recording every matmul's shape.

Must happen: (1) the same output as attention over the valid rows alone, within the kernels' rounding
(:func:`tests.tolerances.attention_atol`; a stale row let through moves it by the order of its values);
(2) every attention matmul reads a multiple of ``GEMM_KEY_BUCKET`` keys with a bucketed count of queries
per query head, and both prompts' forwards use the same set of shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from semkv.models import Runtime, adapter_for
from semkv.models.kernels import GEMM_KEY_BUCKET, bucketed_rows, gemm_attention, softmax_rows
from semkv.models.runtime import padded_positions
from tests.conftest import tiny_hf_model
from tests.tolerances import attention_atol

HEADS, KV_HEADS, DIM = 6, 2, 16


def _qkv(tq: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS, tq, DIM, generator=gen).bfloat16()
    k = torch.randn(KV_HEADS, rows, DIM, generator=gen).bfloat16()
    v = torch.randn(KV_HEADS, rows, DIM, generator=gen).bfloat16()
    return q, k, v


@pytest.mark.parametrize("case", ["suffix", "scattered", "window"])
def test_keys_past_the_valid_rows_change_nothing(case: str) -> None:
    valid, padded_rows = 150, 192
    q, k, v = _qkv(37 if case != "scattered" else 45, padded_rows, seed=1)
    k[:, valid:] = 30.0  # stale rows: they would dominate any softmax they entered
    v[:, valid:] = -30.0
    k_pos = torch.arange(valid)
    if case == "scattered":
        q_pos = torch.sort(torch.randperm(valid, generator=torch.Generator().manual_seed(2))[:45]).values
    else:
        q_pos = torch.arange(valid - q.shape[1], valid)
    window = 24 if case == "window" else None
    want = gemm_attention(q, k[:, :valid], v[:, :valid], q_pos, k_pos, 0.25, window, True)
    got = gemm_attention(q, k, v, q_pos, padded_positions(k_pos, padded_rows), 0.25, window, True)
    atol = attention_atol(q, k[:, :valid], v[:, :valid], 0.25)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.fixture(autouse=True)
def matmul_kernel_for_scattered_rows(monkeypatch):
    """Scattered rows stay on the matmul kernel, whose shapes these tests check, whatever the CPU (AMX
    CPUs would send them through the flash kernel)."""
    import semkv.models.kernels as kernels

    monkeypatch.setattr(kernels, "SCATTERED_ROWS_FLASH", False)


class MatmulShapes(TorchDispatchMode):
    """Records the operand shapes of every aten.mm call, and of every aten.bmm call less its batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        elif func is torch.ops.aten.bmm.default:
            self.shapes.append((tuple(args[0].shape[1:]), tuple(args[1].shape[1:])))
        return func(*args, **(kwargs or {}))


def _attention_shapes(
    runtime: Runtime, prompt: list[int], head_dim: int, rep: int
) -> set[tuple[tuple[int, ...], ...]]:
    """The shapes of the attention matmuls of a prefill of ``prompt``: scores [m, d] @ [d, W] and
    probabilities [m, W] @ [W, d] (the projections run as other ops, or with other widths; a one-query
    decode product, keys [W, d] @ [d, rep] or [rep, W] @ [W, d], has no query group and is left out)."""
    cache = runtime.new_cache(runtime.request_capacity(len(prompt), 1))
    with MatmulShapes() as seen:
        runtime.prefill(cache, prompt)
    return {(a, b) for a, b in seen.shapes if head_dim in (a[1], b[1]) and rep not in (a[0], b[1])}


def test_prefills_of_nearby_lengths_use_the_same_bucketed_shapes(tokenizer) -> None:
    model = tiny_hf_model("llama", len(tokenizer), initializer_range=0.1)
    runtime = Runtime(adapter_for(model.config.model_type)(model), torch.bfloat16, torch.bfloat16)
    rep = model.config.num_attention_heads // model.config.num_key_value_heads
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() for n in (70, 75)]
    head_dim = model.config.head_dim
    shapes = [_attention_shapes(runtime, p, head_dim, rep) for p in prompts]
    assert shapes[0], "no attention matmul was recorded"
    for a, b in shapes[0]:
        queries, keys = a[0], (b[1] if a[1] == head_dim else a[1])
        assert queries % rep == 0 and bucketed_rows(queries // rep) == queries // rep, (a, b)
        assert keys % GEMM_KEY_BUCKET == 0, (a, b)
    assert shapes[0] == shapes[1]


def test_bucketed_rows_repeat_and_pad_under_a_quarter() -> None:
    """A group's computed rows: at least its queries, padded by fewer than 4 rows or a quarter of them,
    and few distinct counts (each is a oneDNN kernel to build) up to the tallest group."""
    counts = {n: bucketed_rows(n) for n in range(1, 257)}
    assert all(0 <= m - n < max(4, n / 4) for n, m in counts.items()), counts
    assert [counts[n] for n in (3, 18, 50, 100, 200, 256)] == [4, 20, 56, 112, 224, 256]
    assert len(set(counts.values())) == 20
    assert all(bucketed_rows(m) == m for m in counts.values())


@pytest.mark.parametrize("rows, width", [(54, 1984), (3, 64), (40, 257)])
def test_softmax_of_the_real_rows_alone_is_the_softmax_of_the_whole_group(rows: int, width: int) -> None:
    """Injected: a query group's scores [R, K] whose rows past ``rows`` are padding (zeros, as zero
    queries score). Must happen: the in-place softmax of the real rows alone gives each of them the same
    bits as the softmax over the whole matrix (a row's softmax reads no other row), and leaves the
    padding as it was (the matmul after it drops those rows)."""
    gen = torch.Generator().manual_seed(rows)
    scores = (torch.randn(rows + 42, width, generator=gen) * 4).bfloat16()
    scores[rows:] = 0
    whole = torch.softmax(scores, dim=-1)
    softmax_rows(scores, rows)
    assert torch.equal(scores[:rows], whole[:rows])
    assert not scores[rows:].any()
