"""Batched decode over shared arena slots against one-sequence decode steps.

Injected: batches of dense in-order caches (the shared path: one indexed write and one attention call per
layer over :class:`DecodeArena` slots), mixed with caches whose rows are out of position order (the
per-sequence path), on a model with sliding-window layers narrower than the context, with sequences
joining, leaving and sitting in slots out of batch order, in fp32 and bf16. Must happen: each row's
logits equal its own one-sequence decode (fp32: 1e-5, greedy tokens identical; bf16: the same tokens),
dense in-order caches are bound to arena slots and the others are not, and a deep copy of a bound cache
owns its rows; a sequence much longer than the others decodes on its own.
"""

from __future__ import annotations

import copy

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.models.cache import KVCache
from tests.conftest import tiny_hf_model

STEPS = 6


def _runtime(family: str, vocab: int, dtype: torch.dtype = torch.float32, **overrides) -> Runtime:
    model = tiny_hf_model(family, vocab, initializer_range=0.1, **overrides)
    return Runtime(adapter_for(model.config.model_type)(model), torch.bfloat16, dtype)


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _twin_caches(runtime: Runtime, prompt: list[int], shuffled: bool = False) -> tuple[KVCache, KVCache, int]:
    """Two caches prefilled alike (one for the batch, one for single steps) and the first greedy token.
    ``shuffled``: rows at their true positions but in a permuted row order (as blend / share leave them)."""
    caches = []
    for _ in range(2):
        cache = runtime.new_cache(len(prompt) + STEPS + 1)
        if shuffled:
            order = torch.randperm(len(prompt) - 1, generator=torch.Generator().manual_seed(5)).tolist()
            order.append(len(prompt) - 1)  # the last prompt token last: its logits are the prefill's
            logits = runtime.prefill(cache, [prompt[p] for p in order], positions=torch.tensor(order))
        else:
            logits = runtime.prefill(cache, prompt)
        caches.append(cache)
    return caches[0], caches[1], int(logits.argmax())


def _decode_together(
    runtime: Runtime, batch: list[KVCache], singles: list[KVCache], tokens: list[int], atol: float
) -> list[int]:
    """One batched step against one single step per cache; returns the next greedy tokens."""
    got = runtime.decode_batch(batch, tokens)
    want = torch.stack([runtime.decode(cache, token) for cache, token in zip(singles, tokens, strict=True)])
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    return want.argmax(-1).tolist()


def _bound(runtime: Runtime, cache: KVCache) -> bool:
    arena = runtime.arena
    return arena is not None and any(arena.bound(slot) is cache for slot in range(len(arena.slots)))


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.15)])
def test_dense_in_order_batch_shares_the_arena(tokenizer, dtype, atol):
    """Three dense caches of different lengths go through the arena and give their single-step logits."""
    runtime = _runtime("llama", len(tokenizer), dtype)
    twins = [_twin_caches(runtime, _prompt(len(tokenizer), n, seed=n)) for n in (9, 40, 23)]
    batch, singles, tokens = (list(x) for x in zip(*twins, strict=True))
    for _ in range(STEPS):
        tokens = _decode_together(runtime, batch, singles, tokens, atol)
        assert all(_bound(runtime, cache) for cache in batch)
        assert not any(_bound(runtime, cache) for cache in singles)  # a batch of one keeps its own buffers
    assert [c.length for c in batch] == [c.length for c in singles]
    assert [c.token_ids for c in batch] == [c.token_ids for c in singles]


def test_mixed_batch_out_of_order_caches_go_per_sequence(tokenizer):
    """Two dense caches share the arena; two caches with shuffled rows, in between them in the batch,
    take the per-sequence path (their keys need masks from positions) and are never bound."""
    runtime = _runtime("llama", len(tokenizer))
    vocab = len(tokenizer)
    twins = [
        _twin_caches(runtime, _prompt(vocab, 30, seed=1)),
        _twin_caches(runtime, _prompt(vocab, 25, seed=2), shuffled=True),
        _twin_caches(runtime, _prompt(vocab, 12, seed=3)),
        _twin_caches(runtime, _prompt(vocab, 33, seed=4), shuffled=True),
    ]
    batch, singles, tokens = (list(x) for x in zip(*twins, strict=True))
    for _ in range(STEPS):
        tokens = _decode_together(runtime, batch, singles, tokens, 1e-5)
        assert [_bound(runtime, cache) for cache in batch] == [True, False, True, False]


def test_window_layers_narrower_than_the_context(tokenizer):
    """Gemma 3 (window 8 on its local layer) with 20-token prompts: the local layer's keys need the window
    cut, so it attends per sequence over the arena rows; the global layer attends together. (Its logits,
    softcapped at 30, are ~10x the llama's: tolerance 1e-4.)"""
    runtime = _runtime("gemma3_text", len(tokenizer))
    twins = [_twin_caches(runtime, _prompt(len(tokenizer), n, seed=n)) for n in (20, 6, 17)]
    batch, singles, tokens = (list(x) for x in zip(*twins, strict=True))
    for _ in range(STEPS):
        tokens = _decode_together(runtime, batch, singles, tokens, 1e-4)
    assert all(_bound(runtime, cache) for cache in batch)


def test_sequences_join_and_leave_the_arena(tokenizer):
    """Slots are reused after a cache is dropped, the arena grows when a larger cache joins (bound caches
    keep their rows), and members in slots out of batch order still get their own rows' attention."""
    runtime = _runtime("llama", len(tokenizer))
    vocab = len(tokenizer)
    pairs = {n: _twin_caches(runtime, _prompt(vocab, n, seed=n)) for n in (10, 21, 15, 40)}
    live = [10, 21]
    tokens = {n: pairs[n][2] for n in pairs}

    def step(order: list[int]) -> None:
        got = _decode_together(
            runtime,
            [pairs[n][0] for n in order],
            [pairs[n][1] for n in order],
            [tokens[n] for n in order],
            1e-5,
        )
        tokens.update(zip(order, got, strict=True))

    step(live)
    step([15, *live])  # joins: the arena grows from 2 slots
    first_slots = len(runtime.arena.slots)
    del pairs[10]  # leaves: its slot is free once the cache is gone
    live = [21, 15]
    step(live)
    assert runtime.arena.occupied() == 2
    step([40, 15, 21])  # a longer cache joins the freed slot: capacity grows, slot order != batch order
    assert runtime.arena.capacity >= pairs[40][0].capacity
    assert len(runtime.arena.slots) == first_slots
    step([21, 40, 15])


def test_a_much_longer_sequence_decodes_on_its_own(tokenizer):
    """A dense cache more than STRAGGLER_LENGTH times the batch's median length takes the per-sequence path
    (the shared call would read every slot up to its length) and is never bound; the arena's capacity stays
    the short ones'. Every row still gets its single-step logits."""
    runtime = _runtime("llama", len(tokenizer))
    vocab = len(tokenizer)
    twins = [_twin_caches(runtime, _prompt(vocab, n, seed=n)) for n in (12, 90, 14, 10)]
    batch, singles, tokens = (list(x) for x in zip(*twins, strict=True))
    for _ in range(STEPS):
        tokens = _decode_together(runtime, batch, singles, tokens, 1e-5)
        assert [_bound(runtime, cache) for cache in batch] == [True, False, True, True]
    assert runtime.arena.capacity < batch[1].capacity


def test_deep_copy_of_a_bound_cache_owns_its_rows(tokenizer):
    runtime = _runtime("llama", len(tokenizer))
    caches = [_twin_caches(runtime, _prompt(len(tokenizer), n, seed=n))[0] for n in (8, 12)]
    runtime.decode_batch(caches, [5, 6])
    assert _bound(runtime, caches[0])
    clone = copy.deepcopy(caches[0])
    assert clone.k_rot[0].untyped_storage().nbytes() < runtime.arena.k_rot[0].untyped_storage().nbytes()
    for layer in range(runtime.num_layers):
        torch.testing.assert_close(clone.keys(layer), caches[0].keys(layer), atol=0, rtol=0)
    clone.k_rot[0].zero_()
    assert bool(caches[0].keys(0).abs().sum() > 0)
