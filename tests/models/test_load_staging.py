"""Reused KV staged in bulk on its way into a cache (``LoadStaging``, ``Runtime.load_pieces``).

Injected: pieces of every kind one after another (plain views of stored entries in float32 and float16, a
gathered piece with zero rows at its gaps, a piece without KV, one-row pieces such as a blend's separators)
and staging budgets from below one layer to every layer at once. Must happen: the staged keys and values
are, layer by layer, each piece's rows in order rounded to the KV dtype, zeros where a piece has none; the
groups cover every layer once, as many as the budget allows; the buffer is reused from call to call, and let
go after a load that outgrew the budget; and a cache loaded under any budget holds the same bits in every row
as one loaded under the largest.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models.registry import adapter_for
from semkv.models.runtime import Runtime
from semkv.models.staging import LoadStaging, RowSource
from tests.conftest import tiny_hf_model

LAYERS, KVH, D = 5, 2, 8


def _pieces(gen: torch.Generator) -> list[RowSource]:
    def stored(m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randn(LAYERS, KVH, m + 3, D, generator=gen).to(dtype)[:, :, 1 : m + 1]  # a strided view
        return k, torch.randn(LAYERS, KVH, m, D, generator=gen).to(dtype)

    k0, v0 = stored(6, torch.float32)
    k1, v1 = stored(1, torch.float16)
    k2, v2 = stored(7, torch.float32)
    k3, v3 = stored(1, torch.float32)
    return [
        RowSource(k0, v0),
        RowSource(k1, v1),
        RowSource.gathered(k2, v2, torch.tensor([4, -1, 0, 6, -1])),
        RowSource.empty(3),
        RowSource(k3, v3),
    ]


def _expected(pieces: list[RowSource], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, kvh, n, d] keys and values of the pieces one after another, built piece by piece and row by row."""
    keys, values = [], []
    for piece in pieces:
        if piece.k is None or piece.v is None:
            keys.append(torch.zeros(LAYERS, KVH, piece.rows, D, dtype=dtype))
            values.append(torch.zeros(LAYERS, KVH, piece.rows, D, dtype=dtype))
            continue
        order = range(piece.rows) if piece.order is None else piece.order.tolist()
        for row in order:
            if row < 0:
                keys.append(torch.zeros(LAYERS, KVH, 1, D, dtype=dtype))
                values.append(torch.zeros(LAYERS, KVH, 1, D, dtype=dtype))
            else:
                keys.append(piece.k[:, :, row : row + 1].to(dtype))
                values.append(piece.v[:, :, row : row + 1].to(dtype))
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


@pytest.mark.parametrize("layers_per_group", [1, 2, 5])
def test_staged_rows_are_each_pieces_rows_in_the_kv_dtype(layers_per_group: int):
    pieces = _pieces(torch.Generator().manual_seed(0))
    count = sum(piece.rows for piece in pieces)
    shape = (KVH, count, D)
    per_layer = 2 * KVH * count * D * 2  # keys and values, float16
    staging = LoadStaging(torch.float16, torch.device("cpu"), budget_bytes=layers_per_group * per_layer)
    groups = staging.layer_groups(LAYERS, shape)
    assert [g.start for g in groups] == list(range(0, LAYERS, layers_per_group))
    assert groups[-1].stop == LAYERS
    want_k, want_v = _expected(pieces, torch.float16)
    orders = [piece.taken(torch.device("cpu")) for piece in pieces]
    storage = None
    for layers in groups:
        keys, values = staging.stage(pieces, orders, layers, shape)
        assert keys.dtype == values.dtype == torch.float16
        assert torch.equal(keys, want_k[layers]) and torch.equal(values, want_v[layers])
        if storage is None:
            storage = keys.untyped_storage().data_ptr()
        assert keys.untyped_storage().data_ptr() == storage  # one buffer, reused
    assert staging.nbytes <= max(staging.budget_bytes, per_layer)


def test_a_budget_below_one_layer_stages_one_layer_at_a_time_and_lets_the_buffer_go():
    staging = LoadStaging(torch.float16, torch.device("cpu"), budget_bytes=1)
    assert staging.layer_groups(3, (KVH, 10, D)) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    pieces = [RowSource(torch.ones(3, KVH, 10, D), torch.ones(3, KVH, 10, D))]
    staging.stage(pieces, [(None, None)], slice(0, 1), (KVH, 10, D))
    assert staging.nbytes == 2 * KVH * 10 * D * 2  # one layer's keys and values, over the budget
    staging.release_excess()
    assert staging.nbytes == 0
    with pytest.raises(ValueError, match="positive"):
        LoadStaging(torch.float16, torch.device("cpu"), budget_bytes=0)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_cache_loaded_in_groups_holds_what_one_loaded_at_once_does(family: str):
    """float16 KV under bfloat16 compute, as the embedded models run."""
    model = tiny_hf_model(family, 64, initializer_range=0.1)
    runtime = Runtime(adapter_for(model.config.model_type)(model), torch.float16, torch.bfloat16)
    layers, kvh, d = runtime.num_layers, runtime.adapter.num_kv_heads, runtime.adapter.head_dim
    gen = torch.Generator().manual_seed(1)
    pieces = [
        RowSource(
            torch.randn(layers, kvh, 9, d, generator=gen), torch.randn(layers, kvh, 9, d, generator=gen)
        ),
        RowSource.empty(2),
        RowSource.gathered(
            torch.randn(layers, kvh, 6, d, generator=gen),
            torch.randn(layers, kvh, 6, d, generator=gen),
            torch.tensor([5, -1, 2, 2]),
        ),
    ]
    count = sum(piece.rows for piece in pieces)
    positions = torch.arange(3, 3 + count) * 2  # not the rows' stored positions: re-rotated
    token_ids = list(range(count))
    caches = []
    for budget in (1, 1 << 30):
        runtime.load_staging = LoadStaging(runtime.kv_dtype, runtime.device, budget_bytes=budget)
        cache = runtime.new_cache(count + 4)
        assert runtime.load_pieces(cache, pieces, positions, token_ids) == 0
        caches.append(cache)
    grouped, whole = caches
    assert grouped.length == whole.length == count
    for layer in range(layers):
        for a, b in zip(
            grouped.row_buffers(layer, slice(0, count)),
            whole.row_buffers(layer, slice(0, count)),
            strict=True,
        ):
            assert torch.equal(a, b)
    # and the rows are what the pieces say: the gathered piece's zero row has zero keys and values
    gap = 9 + 2 + 1
    for buffer in whole.row_buffers(0, slice(gap, gap + 1)):
        assert not buffer.any()
