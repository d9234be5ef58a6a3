"""Decode attention over a cache's whole buffers, the rows past its length masked.

Injected: bf16 decode steps on caches whose capacity is at most 1.25x their length (the whole-buffer path:
one contiguous [kvh, capacity, d] operand per layer, rows past the length hidden by a mask) against twins
whose capacity is 4x (the valid-rows path); rows past the length holding large stale values (as a
truncation leaves them), and fresh buffers from an allocator that hands out NaN-filled memory.
Must happen: the same logits as the valid-rows path (the masked rows contribute exactly nothing), rows
past the length zeroed when a cache grows (a NaN there would make 0 x value NaN), and
:func:`decode_products` giving the same result whether its keys are a contiguous buffer or a slice.
"""

from __future__ import annotations

import pytest
import torch

import semkv.models.cache as cache_module
from semkv.models import Runtime, adapter_for
from semkv.models.cache import KVCache
from semkv.models.kernels import decode_products
from tests.conftest import tiny_hf_model

VOCAB = 96
PROMPT = 40
STEPS = 5


def _runtime() -> Runtime:
    model = tiny_hf_model("llama", VOCAB, initializer_range=0.1)
    return Runtime(adapter_for(model.config.model_type)(model), torch.bfloat16, torch.bfloat16)


def _prompt() -> list[int]:
    return torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()


def _prefilled(runtime: Runtime, capacity: int) -> tuple[KVCache, int]:
    cache = runtime.new_cache(capacity)
    logits = runtime.prefill(cache, _prompt())
    return cache, int(logits.argmax())


def test_whole_buffer_decode_equals_decode_over_the_valid_rows() -> None:
    runtime = _runtime()
    tight, token = _prefilled(runtime, PROMPT + STEPS)
    loose, _ = _prefilled(runtime, 4 * (PROMPT + STEPS))
    assert runtime.whole_buffers(tight, True) is not None
    assert runtime.whole_buffers(loose, True) is None
    for layer in range(tight.num_layers):  # stale rows past the length, as a truncation leaves them
        tight.k_rot[layer][:, PROMPT:] = 30.0
        tight.v[layer][:, PROMPT:] = -30.0
    for _ in range(STEPS):
        got, want = runtime.decode(tight, token), runtime.decode(loose, token)
        torch.testing.assert_close(got.float(), want.float(), atol=0.0, rtol=0.0)
        token = int(want.argmax())


def test_grown_buffers_hold_zeros_past_the_length(monkeypatch: pytest.MonkeyPatch) -> None:
    real_empty = torch.empty

    def nan_memory(*args, **kwargs):  # what an allocator may hand back: anything, NaN included
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(cache_module.torch, "empty", nan_memory)
    runtime = _runtime()
    cache, token = _prefilled(runtime, PROMPT + 2)
    cache.reserve(PROMPT + STEPS)  # grows: a fresh buffer, the prompt's rows copied in
    monkeypatch.undo()
    for layer in range(cache.num_layers):
        assert torch.equal(
            cache.k_rot[layer][:, cache.length :], torch.zeros_like(cache.k_rot[layer][:, cache.length :])
        )
        assert torch.equal(
            cache.v[layer][:, cache.length :], torch.zeros_like(cache.v[layer][:, cache.length :])
        )
    while runtime.whole_buffers(cache, True) is None:  # doubled: decode until the padding is small
        assert cache.length < cache.capacity
        token = int(runtime.decode(cache, token).argmax())
    for _ in range(STEPS):
        logits = runtime.decode(cache, token)
        assert bool(torch.isfinite(logits).all())
        token = int(logits.argmax())


@pytest.mark.parametrize("masked", [False, True])
def test_decode_products_contiguous_and_sliced_keys_agree(masked: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 200, 16, generator=gen).bfloat16()
    values = torch.randn(3, 200, 16, generator=gen).bfloat16()
    query = torch.randn(9, 1, 16, generator=gen).bfloat16()
    bias = None
    if masked:
        bias = torch.zeros(1, 150, dtype=torch.bfloat16)
        bias[:, 100:] = float("-inf")
    sliced = decode_products(query, keys[:, :150], values[:, :150], bias)
    whole = decode_products(query, keys[:, :150].contiguous(), values[:, :150].contiguous(), bias)
    torch.testing.assert_close(sliced.float(), whole.float(), atol=1e-2, rtol=0.0)


def test_a_cache_left_alone_in_an_arena_slot_decodes_over_the_slot() -> None:
    """Two caches decode together in arena slots as wide as the wider one; the other leaves and the
    narrower one decodes alone over its slot, whose buffers are longer than its own capacity (the mask
    must span the slot's rows, not the capacity). It must keep giving its twin's tokens."""
    runtime = _runtime()
    prompt = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    narrow, twin = runtime.new_cache(62), runtime.new_cache(62)
    token = int(runtime.prefill(narrow, prompt[:56]).argmax())
    runtime.prefill(twin, prompt[:56])
    wide = runtime.new_cache(64)
    wide_token = int(runtime.prefill(wide, prompt).argmax())
    tokens = [token, token]
    for _ in range(2):
        together = runtime.decode_batch([narrow, wide], [tokens[0], wide_token])
        alone = runtime.decode(twin, tokens[1])
        tokens = [int(together[0].argmax()), int(alone.argmax())]
        wide_token = int(together[1].argmax())
        assert tokens[0] == tokens[1]
    assert narrow.in_arena and narrow.k_rot[0].shape[1] > narrow.capacity
    span = runtime.whole_buffers(narrow, True)
    assert span is not None and span.rows == narrow.k_rot[0].shape[1]
    for _ in range(3):
        got, want = runtime.decode(narrow, tokens[0]), runtime.decode(twin, tokens[1])
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=0.0)
        tokens = [int(got.argmax()), int(want.argmax())]
        assert tokens[0] == tokens[1]
