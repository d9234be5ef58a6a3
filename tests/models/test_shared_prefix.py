"""Caches that read one shared prefix instead of each holding a copy.

Injected: caches started from a :class:`SharedPrefix` — written to past it and into it, deep-copied,
truncated below it, exported across it; a batch mixing caches of two prefixes of different lengths with a
cache of its own, through the two-piece kernel; batched decode of sequences sharing a prefix on a model
with global attention and on one with sliding-window layers narrower than the context, in fp32 and bf16;
a cache left alone with its prefix; three requests of an engine hitting one pooled prompt.

Must happen: every read gives the rows a cache with its own copy would give (keys, values, exports
equal bit for bit; attention and logits within what different summation orders may leave,
:mod:`tests.tolerances`; greedy tokens identical); a write into a prefix row copies the prefix in first
and leaves the prefix as it was; live KV counts the prefix once; a lone reader copies it in before it
decodes; the engine's three requests read one prefix object.
"""

from __future__ import annotations

import copy

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.models.cache import KVCache, SharedPrefix
from semkv.models.kernels import PrefixPiece, batched_decode_with_prefixes, decode_products
from semkv.request import GenerateRequest
from tests.conftest import tiny_hf_model
from tests.tolerances import attention_atol, config_atol

STEPS = 5
KVH, D, LAYERS = 2, 8, 2


def _random_prefix(
    rows: int, seed: int, dtype: torch.dtype = torch.float32, pool_views: bool = False
) -> SharedPrefix:
    """Random rows; ``pool_views``: each layer's rows a range of a longer buffer (strided across heads, as
    a prefix reading consecutive pool pages in place is)."""
    gen = torch.Generator().manual_seed(seed)

    def bufs() -> list[torch.Tensor]:
        if pool_views:
            return [
                torch.randn(KVH, rows + 11, D, generator=gen).to(dtype)[:, 3 : 3 + rows]
                for _ in range(LAYERS)
            ]
        return [torch.randn(KVH, rows, D, generator=gen).to(dtype) for _ in range(LAYERS)]

    return SharedPrefix.of_rows(bufs(), bufs(), bufs(), token_ids=list(range(rows)))


def _cache(capacity: int) -> KVCache:
    return KVCache(LAYERS, KVH, D, capacity, torch.float32, torch.float32)


def _fill_tail(cache: KVCache, count: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    first = cache.length
    cache.append_rows(torch.arange(first, first + count), list(range(count)))
    for layer in range(LAYERS):
        k, r, v = (torch.randn(KVH, count, D, generator=gen) for _ in range(3))
        cache.write(layer, slice(first, first + count), k, r, v)


def test_reads_writes_and_copies_of_a_cache_on_a_shared_prefix():
    prefix = _random_prefix(12, seed=0)
    cache = _cache(20)
    cache.share_prefix(prefix)
    _fill_tail(cache, 5, seed=1)
    assert (cache.base, cache.length, cache.own_length) == (12, 17, 5)
    assert cache.held_bytes() == (20 - 12) * cache.row_bytes  # the prefix is not its own
    whole = [torch.cat((prefix.k_rot[layer], cache.own_k_rot[layer][:, :5]), 1) for layer in range(LAYERS)]
    assert torch.equal(cache.keys(1), whole[1])
    k, v = cache.export(10, 15)  # across the boundary
    assert torch.equal(k[0], torch.cat((prefix.k_pre_rows(0, 10, 12), cache.own_k_pre[0][:, :3]), 1))
    assert torch.equal(v[1], torch.cat((prefix.v[1][:, 10:], cache.own_v[1][:, :3]), 1))

    twin = copy.deepcopy(cache)  # shares the prefix, owns its rows
    assert twin.prefix is prefix and set(prefix.holders) == {cache, twin}
    assert prefix.held_by_others(cache)

    before = [t.clone() for t in prefix.k_rot]
    cache.write(0, slice(3, 4), *(torch.ones(KVH, 1, D) for _ in range(3)))  # a prefix row: copy first
    assert cache.prefix is None and cache.base == 0 and set(prefix.holders) == {twin}
    assert all(torch.equal(a, b) for a, b in zip(before, prefix.k_rot, strict=True))  # prefix untouched
    assert torch.equal(cache.keys(0)[:, 3:4], torch.ones(KVH, 1, D))
    assert torch.equal(cache.keys(1), whole[1])  # the other rows as they were
    assert torch.equal(twin.keys(0), whole[0])

    twin.truncate(8)  # below the prefix: copied in, then cut
    assert twin.prefix is None and twin.length == 8
    assert torch.equal(twin.keys(0), prefix.k_rot[0][:, :8])
    assert not prefix.holders


@pytest.mark.parametrize("pool_views", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_piece_kernel_matches_attention_over_the_joined_rows(dtype, pool_views):
    """Sequences 0 and 2 read prefix A (9 rows; sequence 2 only its first 5), 3 reads prefix B (14
    rows), 1 has none; own rows of different lengths are masked past each length. Then all four read
    prefix B whole (the path without indexing). Prefix rows held contiguous, or as views of longer
    buffers (a prefix on pool pages)."""
    nh, width, n = 4, 6, 4
    gen = torch.Generator().manual_seed(3)
    prefix_a, prefix_b = _random_prefix(9, 4, dtype, pool_views), _random_prefix(14, 5, dtype, pool_views)
    q = (torch.randn(n, nh, D, generator=gen) * D**-0.5).to(dtype)
    k = torch.randn(n, KVH, width, D, generator=gen).to(dtype)
    v = torch.randn(n, KVH, width, D, generator=gen).to(dtype)
    lengths = [6, 2, 4, 5]
    bias = torch.zeros(n, 1, 1, width, dtype=dtype)
    for i, length in enumerate(lengths):
        bias[i, ..., length:] = float("-inf")
    partial = torch.zeros(2, 1, 1, 9, dtype=dtype)
    partial[1, ..., 5:] = float("-inf")
    pieces = [
        PrefixPiece(prefix_a.k_rot[0], prefix_a.float_values(0), torch.tensor([0, 2]), partial),
        PrefixPiece(prefix_b.k_rot[0], prefix_b.float_values(0), torch.tensor([3])),
    ]
    mixed = batched_decode_with_prefixes(q, k, v, bias, pieces)
    everyone = batched_decode_with_prefixes(
        q, k, v, bias, [PrefixPiece(prefix_b.k_rot[0], prefix_b.float_values(0))]
    )
    for got, heads in ((mixed, {0: (prefix_a, 9), 2: (prefix_a, 5), 3: (prefix_b, 14)}), (everyone, None)):
        for i, length in enumerate(lengths):
            keys, values = k[i, :, :length], v[i, :, :length]
            head, rows = (prefix_b, 14) if heads is None else heads.get(i, (None, 0))
            if head is not None:
                keys = torch.cat((head.k_rot[0][:, :rows], keys), 1)
                values = torch.cat((head.v[0][:, :rows].to(dtype), values), 1)
            query = q[i].unsqueeze(1)  # [nh, 1, d]
            want = decode_products(query.float(), keys.float(), values.float(), None)
            atol = attention_atol(query, keys, values, 1.0, dtype)
            torch.testing.assert_close(got[i : i + 1].float(), want, atol=atol, rtol=0)


def _runtime(family: str, vocab: int, dtype: torch.dtype) -> Runtime:
    model = tiny_hf_model(family, vocab, initializer_range=0.1)
    return Runtime(adapter_for(model.config.model_type)(model), torch.bfloat16, dtype)


def _prefix_of(runtime: Runtime, tokens: list[int]) -> SharedPrefix:
    """A prefix holding what a prefill of ``tokens`` writes."""
    cache = runtime.new_cache(len(tokens))
    runtime.prefill(cache, tokens)
    rows = len(tokens)
    bufs = [[b[:, :rows].clone() for b in bufs] for bufs in (cache.k_pre, cache.k_rot, cache.v)]
    return SharedPrefix.of_rows(*bufs, token_ids=tokens)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_over_a_shared_prefix_gives_the_copies_logits(tokenizer, family, dtype):
    """Three caches read a 24-token prefix (tails of 3, 7 and 5 tokens; the third reads only its first
    16 rows and holds the other 8 itself) beside a cache of its own. On
    the global layers the sharing caches attend together through the two-piece kernel; Gemma 3's local
    layers (window 8) cut the keys per sequence: the shortest tail's window reaches into the prefix for
    its first steps (prefix and own rows joined), the others' lie in their own rows."""
    runtime = _runtime(family, len(tokenizer), dtype)
    gen = torch.Generator().manual_seed(7)
    vocab = len(tokenizer)
    head = torch.randint(3, vocab, (24,), generator=gen).tolist()
    tails = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 7, 5)]
    alone = torch.randint(3, vocab, (19,), generator=gen).tolist()
    prefix = _prefix_of(runtime, head)

    shared, copies, tokens = [], [], []
    for n, tail in enumerate(tails):
        reads = 16 if n == 2 else len(head)  # the third reads only the prefix's first 16 rows
        tail = head[reads:] + tail
        cache = runtime.new_cache(len(head) + len(tail) + STEPS + 1)
        cache.share_prefix(prefix, reads)
        logits = runtime.prefill(cache, tail)
        full = runtime.new_cache(cache.capacity)
        want = runtime.prefill(full, head[:reads] + tail)
        assert int(logits.argmax()) == int(want.argmax())
        shared.append(cache)
        copies.append(full)
        tokens.append(int(want.argmax()))
    own = runtime.new_cache(len(alone) + STEPS + 1)
    tokens.append(int(runtime.prefill(own, alone).argmax()))
    own_copy = copy.deepcopy(own)
    batch, singles = [*shared, own], [*copies, own_copy]
    held_shared = sum(c.held_bytes() for c in shared) + prefix.nbytes()
    assert held_shared < sum(c.held_bytes() for c in copies)

    for _ in range(STEPS):
        got = runtime.decode_batch(batch, tokens)
        want = torch.stack([runtime.decode(c, t) for c, t in zip(singles, tokens, strict=True)])
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        context = max(c.length for c in singles)
        atol = config_atol(want.float(), runtime.adapter.hf_model.config, dtype, context)
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
        tokens = want.argmax(-1).tolist()
    assert all(c.prefix is prefix for c in shared)  # still read together, never copied in
    assert [c.token_ids for c in batch] == [c.token_ids for c in singles]


def test_a_lone_reader_copies_the_prefix_in_before_decoding(tokenizer):
    runtime = _runtime("llama", len(tokenizer), torch.float32)
    head = list(range(10, 30))
    prefix = _prefix_of(runtime, head)
    cache = runtime.new_cache(32)
    cache.share_prefix(prefix)
    first = int(runtime.prefill(cache, [40, 41, 42]).argmax())
    full = runtime.new_cache(32)
    want_first = int(runtime.prefill(full, head + [40, 41, 42]).argmax())
    assert first == want_first
    got = runtime.decode(cache, first)
    assert cache.prefix is None and not prefix.holders  # copied in: one piece of attention
    want = runtime.decode(full, want_first)
    assert int(got.argmax()) == int(want.argmax())
    torch.testing.assert_close(got, want, atol=config_atol(want, runtime.adapter.hf_model.config), rtol=0)


def test_requests_hitting_one_pooled_prompt_read_one_prefix(make_tiny_engine):
    """Three requests ask other questions about one stored document; a fourth repeats the stored
    prompt's question and more, so more of its prompt is pooled: it reads the same prefix as far as that
    holds its pages and the rest from the pages into rows of its own. All rows equal a fresh prefill's."""
    doc = " ".join(f"Line {i} says item {i} is {i * 7 % 13}." for i in range(20))
    engine = make_tiny_engine("llama", kv_dtype="float16", compute_dtype="bfloat16")
    engine.generate(prompt=doc + " Which line is the longest?", max_new_tokens=2, stop_at_eos=False)
    prompts = [doc + f" Item {i}?" for i in range(3)] + [doc + " Which line is the longest? Say why."]
    hits = [engine.prefill(GenerateRequest(prompt=p, max_new_tokens=4)) for p in prompts]
    assert all(hit.outcome.path == "prefix" for hit in hits)
    prefix = hits[0].cache.prefix
    assert prefix is not None and all(hit.cache.prefix is prefix for hit in hits)
    assert [hit.cache.base for hit in hits[:3]] == [hits[0].outcome.reused_tokens] * 3
    longer = hits[3]
    assert longer.cache.base == hits[0].cache.base < longer.outcome.reused_tokens
    held = engine.live_kv_bytes()
    assert held < sum(hit.cache.capacity * hit.cache.row_bytes for hit in hits)
    for hit, prompt in zip(hits, prompts, strict=True):
        fresh = engine.prefill(GenerateRequest(prompt=prompt, reuse="none", store_prompt=False))
        for layer in (0, 1):
            assert torch.equal(hit.cache.keys(layer), fresh.cache.keys(layer))
            assert torch.equal(hit.cache.values(layer), fresh.cache.values(layer))
        k, v = hit.cache.export(0, hit.cache.length)
        assert torch.equal(k, fresh.cache.export(0, fresh.cache.length)[0])
        assert torch.equal(v, fresh.cache.export(0, fresh.cache.length)[1])
