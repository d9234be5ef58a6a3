"""Batched decode over shared arena slots against one-sequence decode steps.

Injected: batches of dense in-order caches (the shared path: one indexed write and one attention call per
layer over :class:`DecodeArena` slots), mixed with caches whose rows are out of position order (the
per-sequence path), on a model with sliding-window layers narrower than the context, with sequences
joining, leaving and sitting in slots out of batch order, in fp32 and bf16. Must happen: each row's
logits equal its own one-sequence decode (within what the kernels' different summation orders may leave:
:mod:`tests.tolerances`, from the dtype, the model's reductions and the logits' scale; greedy tokens identical),
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
from tests.tolerances import config_atol

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


def _atol(runtime: Runtime, want: torch.Tensor, caches: list[KVCache]) -> float:
    """What batched and one-sequence kernels' summation orders may leave between two logits of ``want``'s
    scale (:func:`tests.tolerances.config_atol`): the batched step multiplies B rows at once (other GEMM
    blocking) and attends over arena slots in one call."""
    context = max(cache.length for cache in caches)
    return config_atol(want.float(), runtime.adapter.hf_model.config, runtime.compute_dtype, context)


def _decode_together(
    runtime: Runtime, batch: list[KVCache], singles: list[KVCache], tokens: list[int]
) -> list[int]:
    """One batched step against one single step per cache; returns the next greedy tokens."""
    got = runtime.decode_batch(batch, tokens)
    want = torch.stack([runtime.decode(cache, token) for cache, token in zip(singles, tokens, strict=True)])
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    atol = _atol(runtime, want, singles)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    return want.argmax(-1).tolist()


def _bound(runtime: Runtime, cache: KVCache) -> bool:
    arena = runtime.arena
    return arena is not None and any(arena.bound(slot) is cache for slot in range(len(arena.slots)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_in_order_batch_shares_the_arena(tokenizer, dtype):
    """Three dense caches of different lengths go through the arena and give their single-step logits."""
    runtime = _runtime("llama", len(tokenizer), dtype)
    twins = [_twin_caches(runtime, _prompt(len(tokenizer), n, seed=n)) for n in (9, 40, 23)]
    batch, singles, tokens = (list(x) for x in zip(*twins, strict=True))
    for _ in range(STEPS):
        tokens = _decode_together(runtime, batch, singles, tokens)
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
        tokens = _decode_together(runtime, batch, singles, tokens)
        assert [_bound(runtime, cache) for cache in batch] == [True, False, True, False]


def test_window_layers_narrower_than_the_context(tokenizer):
    """Gemma 3 (window 8 on its local layer) with 20-token prompts: the local layer's keys need the window
    cut, so it attends per sequence over the arena rows; the global layer attends together. (Its logits,
    softcapped at 30, are ~10x the llama's: the tolerance follows their scale.)"""
    runtime = _runtime("gemma3_text", len(tokenizer))
    twins = [_twin_caches(runtime, _prompt(len(tokenizer), n, seed=n)) for n in (20, 6, 17)]
    batch, singles, tokens = (list(x) for x in zip(*twins, strict=True))
    for _ in range(STEPS):
        tokens = _decode_together(runtime, batch, singles, tokens)
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
        tokens = _decode_together(runtime, batch, singles, tokens)
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


# -- KV memory held (what the scheduler's live-KV budget counts) ------------------------------------------
def _storage_bytes(runtime: Runtime, caches: list[KVCache]) -> int:
    """The oracle: bytes of the distinct storages behind the caches' K/V buffers and the arena's."""
    buffers = [buf for cache in caches for buf in (*cache.k_pre, *cache.k_rot, *cache.v)]
    if runtime.arena is not None:
        buffers += [*runtime.arena.k_pre, *runtime.arena.k_rot, *runtime.arena.v]
    storages = {buf.untyped_storage().data_ptr(): buf.untyped_storage().nbytes() for buf in buffers}
    return sum(storages.values())


def _decode_pairs(
    runtime: Runtime, pairs: dict, tokens: dict, order: list, kv_limit: int | None = None
) -> None:
    """One batched step of ``pairs[n][0]`` for n in ``order`` against single steps of their twins."""
    batch = [pairs[n][0] for n in order]
    got = runtime.decode_batch(batch, [tokens[n] for n in order], kv_limit=kv_limit)
    want = torch.stack([runtime.decode(pairs[n][1], tokens[n]) for n in order])
    torch.testing.assert_close(got, want, atol=_atol(runtime, want, [pairs[n][1] for n in order]), rtol=0)
    tokens.update(zip(order, want.argmax(-1).tolist(), strict=True))


def test_held_bytes_count_the_arena_with_its_free_slots_and_padding(tokenizer):
    """kv_held_bytes equals the bytes of the distinct storages really allocated at every point: own caches
    before they bind; after binding the arena only (slots x aligned capacity, padding included); after a
    slot doubling the doubled arena, free slots included; a free slot stays counted after its cache left;
    a cache made with claim_slot starts in that free slot (no new memory) and prefills there exactly."""
    runtime = _runtime("llama", len(tokenizer))
    vocab, row = len(tokenizer), runtime.kv_bytes_per_token()
    pairs = {n: _twin_caches(runtime, _prompt(vocab, n, seed=n)) for n in (9, 20, 14, 11)}
    tokens = {n: pairs[n][2] for n in pairs}
    own = sum(pairs[n][0].capacity for n in (9, 20, 14)) * row

    def held(extra: list[KVCache] = ()) -> int:
        caches = [c for pair in pairs.values() for c in pair[:2]] + list(extra)
        singles = sum(pairs[n][1].capacity for n in pairs) * row  # the twins decode on their own buffers
        assert runtime.kv_held_bytes() == _storage_bytes(runtime, caches)
        return runtime.kv_held_bytes() - singles

    assert held() == own + pairs[11][0].capacity * row
    _decode_pairs(runtime, pairs, tokens, [9, 20, 14])
    assert len(runtime.arena.slots) == 3 and runtime.arena.capacity == 32  # 20 + 7 rows -> 32
    assert held() == 3 * 32 * row + pairs[11][0].capacity * row
    _decode_pairs(runtime, pairs, tokens, [9, 20, 14, 11])  # a fourth joins: 3 -> 6 slots
    assert len(runtime.arena.slots) == 6 and held() == 6 * 32 * row
    del pairs[9]
    _decode_pairs(runtime, pairs, tokens, [20, 14, 11])
    assert runtime.arena.occupied() == 3 and held() == 6 * 32 * row  # free slots stay held
    claimed = runtime.new_cache(15, claim_slot=True)
    assert claimed.in_arena and held([claimed]) == 6 * 32 * row
    alone = runtime.new_cache(15)
    prompt = _prompt(vocab, 8, seed=8)
    torch.testing.assert_close(
        runtime.prefill(claimed, prompt), runtime.prefill(alone, prompt), atol=0, rtol=0
    )
    assert held([claimed, alone]) == 6 * 32 * row + 15 * row


def test_arena_growth_stays_within_the_kv_limit(tokenizer):
    """With a kv_limit the arena grows to just the slots needed when a doubling's peak would pass it; a
    cache it has no room for decodes on its own buffers (same logits) and binds once a slot is free, giving
    its own buffers back. Held bytes never pass the limit."""
    runtime = _runtime("llama", len(tokenizer))
    vocab, row, layers = len(tokenizer), runtime.kv_bytes_per_token(), runtime.num_layers
    pairs = {n: _twin_caches(runtime, _prompt(vocab, n, seed=n)) for n in (10, 12, 9, 11)}
    tokens = {n: pairs[n][2] for n in pairs}
    singles = sum(pairs[n][1].capacity for n in pairs) * row
    _decode_pairs(runtime, pairs, tokens, [10, 12])
    assert len(runtime.arena.slots) == 2 and runtime.arena.capacity == 32
    two, joining, other = 2 * 32 * row, pairs[9][0].capacity * row, pairs[11][0].capacity * row
    # growing to 3 slots peaks at 3 slots + one layer of (2 slots + the joining cache); 4 slots need more
    limit = singles + other + 3 * 32 * row + (two + joining) // layers
    _decode_pairs(runtime, pairs, tokens, [10, 12, 9], kv_limit=limit - 1)  # one byte short: no growth
    assert len(runtime.arena.slots) == 2 and not pairs[9][0].in_arena
    _decode_pairs(runtime, pairs, tokens, [10, 12, 9], kv_limit=limit)
    assert len(runtime.arena.slots) == 3 and runtime.kv_held_bytes() <= limit
    assert runtime.kv_held_bytes() == singles + 3 * 32 * row + other
    tight = runtime.kv_held_bytes()  # no room to grow: 11 decodes on its own buffers
    for _ in range(2):
        _decode_pairs(runtime, pairs, tokens, [10, 12, 9, 11], kv_limit=tight)
        assert not pairs[11][0].in_arena and len(runtime.arena.slots) == 3
        assert runtime.kv_held_bytes() == tight
    del pairs[12]
    _decode_pairs(runtime, pairs, tokens, [10, 9, 11], kv_limit=tight)  # 11 takes the freed slot
    assert pairs[11][0].in_arena
    singles = sum(pairs[n][1].capacity for n in pairs) * row
    assert runtime.kv_held_bytes() == _storage_bytes(runtime, [c for p in pairs.values() for c in p[:2]])
    assert runtime.kv_held_bytes() == singles + 3 * 32 * row <= tight


def test_a_mostly_empty_arena_shrinks_to_its_bound_caches(tokenizer):
    """Once at most a quarter of the slots are bound, trim_arena reallocates to the bound caches (slots
    compacted, capacity their widest), unless the reallocation's peak would pass the kv_limit; an arena
    with no bound cache is dropped. The caches left keep decoding with their own single-step logits."""
    runtime = _runtime("llama", len(tokenizer))
    vocab, row, layers = len(tokenizer), runtime.kv_bytes_per_token(), runtime.num_layers
    pairs = {n: _twin_caches(runtime, _prompt(vocab, n, seed=n)) for n in (8, 9, 10, 11, 12, 13, 14, 22)}
    tokens = {n: pairs[n][2] for n in pairs}
    _decode_pairs(runtime, pairs, tokens, [22, 8, 9, 10, 11, 12, 13, 14])  # 22 is no straggler: <= 2 x 12
    assert len(runtime.arena.slots) == 8 and runtime.arena.capacity == 32
    for n in (22, 10, 11, 12, 13, 14):
        del pairs[n]
    singles = sum(pairs[n][1].capacity for n in pairs) * row
    old, new = 8 * 32 * row, 2 * 16 * row  # the two left have 8 + 7 and 9 + 7 rows: 16, the widest gone
    runtime.trim_arena(kv_limit=singles + old + new // layers - 1)  # the peak would pass it by one byte
    assert len(runtime.arena.slots) == 8
    runtime.trim_arena(kv_limit=singles + old + new // layers)
    assert len(runtime.arena.slots) == 2 and runtime.arena.capacity == 16
    live = [c for p in pairs.values() for c in p[:2]]
    assert runtime.kv_held_bytes() == singles + new == _storage_bytes(runtime, live)
    del live
    for _ in range(2):
        _decode_pairs(runtime, pairs, tokens, [9, 8])
    pairs.clear()
    runtime.trim_arena()
    assert runtime.arena is None and runtime.kv_held_bytes() == 0
