"""A batched decode step over shared prefixes with every key row joined into one matrix per layer.

Injected: five arena slots — slot 0 reads all 9 rows of prefix A, slot 2 reads prefix A's first 5 only,
slot 4 reads 14 rows of prefix B, slot 3 reads no prefix, slot 1 is no member (its output is discarded);
own rows of different lengths, masked past each length; prefix rows held as views of longer buffers (a
prefix on pool pages), in fp32 and bf16. Then batched decode of caches reading one prefix through the
runtime, with the joined form forced on and off.

Must happen: the mask shows each member exactly its prefix's first ``base`` rows and its own valid rows
(exact columns); each member's output is attention over exactly those rows (within what different
summation orders may leave, :mod:`tests.tolerances`); the runtime takes the joined form where it is
allowed and gives the same greedy tokens and logits as the two-piece kernel and as caches holding their
own copies.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import semkv.models.runtime as runtime_module
from semkv.models import Runtime
from semkv.models.cache import KVCache, SharedPrefix
from semkv.models.kernels import decode_products
from semkv.models.runtime import JoinedRows
from tests.models.test_shared_prefix import KVH, LAYERS, D, _prefix_of, _random_prefix, _runtime
from tests.tolerances import attention_atol, config_atol

NH = 4  # query heads over test_shared_prefix's KVH = 2


# (relative slot, prefix name or None, prefix rows read, own rows); slot 1 is not a member
MEMBERS = [(0, "a", 9, 6), (2, "a", 5, 2), (3, None, 0, 4), (4, "b", 14, 5)]
WIDTH = 7


def _joined(dtype: torch.dtype) -> tuple[JoinedRows, dict[str, SharedPrefix]]:
    # prefix rows held as views of longer buffers (strided across heads, as pool pages are)
    prefixes = {
        "a": _random_prefix(9, 4, dtype, pool_views=True),
        "b": _random_prefix(14, 5, dtype, pool_views=True),
    }
    groups = [
        (
            prefixes[name],
            [slot for slot, p, _, _ in MEMBERS if p == name],
            [n for _, p, n, _ in MEMBERS if p == name],
        )
        for name in ("a", "b")
    ]
    slots = [slot for slot, *_ in MEMBERS]
    lengths = [own for *_, own in MEMBERS]
    return JoinedRows.of(groups, lengths, slots, WIDTH, dtype), prefixes


def test_the_mask_shows_each_member_its_prefix_rows_and_its_own_rows():
    joined, _ = _joined(torch.float32)
    assert joined.columns == 9 + 14 + 5 * WIDTH
    visible = joined.bias == 0
    offsets = {"a": 0, "b": 9}
    for slot, name, read, own in MEMBERS:
        want = torch.zeros(joined.columns, dtype=torch.bool)
        if name is not None:
            want[offsets[name] : offsets[name] + read] = True
        first = 23 + slot * WIDTH
        want[first : first + own] = True
        assert torch.equal(visible[slot], want), slot
    assert bool(visible[1].all())  # not a member: every column (finite), output discarded
    assert bool(torch.isinf(joined.bias[~visible]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_member_attends_over_exactly_its_rows(dtype):
    joined, prefixes = _joined(dtype)
    gen = torch.Generator().manual_seed(11)
    slots = 5
    q = (torch.randn(slots, NH, D, generator=gen) * D**-0.5).to(dtype)
    own_k = torch.randn(slots, KVH, WIDTH + 3, D, generator=gen).to(dtype)  # arena slots wider than read
    own_v = torch.randn(slots, KVH, WIDTH + 3, D, generator=gen).to(dtype)
    for layer in range(LAYERS):
        got = joined.attend(q, layer, own_k, own_v)
        assert got.shape == (slots, NH * D)
        for slot, name, read, own in MEMBERS:
            keys, values = own_k[slot, :, :own], own_v[slot, :, :own]
            if name is not None:
                keys = torch.cat((prefixes[name].k_rot[layer][:, :read], keys), 1)
                values = torch.cat((prefixes[name].v[layer][:, :read], values), 1)
            query = q[slot].unsqueeze(1)  # [nh, 1, d]
            want = decode_products(query.float(), keys.float(), values.float(), None)
            atol = attention_atol(query, keys, values, 1.0, dtype)
            torch.testing.assert_close(got[slot : slot + 1].float(), want, atol=atol, rtol=0)


STEPS = 6


def decode_beside_copies(
    runtime: Runtime,
    readers: list[KVCache],
    copies: list[KVCache],
    tokens: list[int],
    steps: int,
    after_step: Callable[[], None] | None = None,
) -> None:
    """``steps`` batched bf16 decode steps of ``readers``, each against one decode step of every cache in
    ``copies`` (the same prompts, rows held whole): the same greedy tokens, logits within what different
    summation orders may leave; ``after_step`` checks more after each step."""
    config = runtime.adapter.hf_model.config
    for _ in range(steps):
        got = runtime.decode_batch(readers, tokens)
        want = torch.stack([runtime.decode(c, t) for c, t in zip(copies, tokens, strict=True)])
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        atol = config_atol(want.float(), config, torch.bfloat16, max(c.length for c in copies))
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
        tokens = want.argmax(-1).tolist()
        if after_step is not None:
            after_step()
    assert [r.token_ids for r in readers] == [c.token_ids for c in copies]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("joined_factor", [0.0, 100.0])
def test_batched_decode_over_one_prefix_joined_or_in_two_pieces(
    tokenizer, monkeypatch, joined_factor, family
):
    """Four caches read a 30-token prefix (one only its first 20 rows) and decode together; the joined
    form is forbidden (factor 0) or always allowed (100), and counted. Gemma 3's sliding-window layers
    attend per sequence where the window does not cover a sequence's keys (its global layers join)."""
    runtime = _runtime(family, len(tokenizer), torch.bfloat16)
    monkeypatch.setattr(runtime_module, "JOINED_COLUMNS_FACTOR", joined_factor)
    calls = []
    real = runtime_module.joined_decode_attention
    monkeypatch.setattr(runtime_module, "joined_decode_attention", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(7)
    vocab = len(tokenizer)
    head = torch.randint(3, vocab, (30,), generator=gen).tolist()
    prefix = _prefix_of(runtime, head)
    shared, copies, tokens = [], [], []
    for n, tail_length in enumerate((3, 6, 4, 5)):
        reads = 20 if n == 1 else len(head)
        tail = head[reads:] + torch.randint(3, vocab, (tail_length,), generator=gen).tolist()
        reader = runtime.new_cache(len(head) + len(tail) + STEPS + 1)
        reader.share_prefix(prefix, reads)
        runtime.prefill(reader, tail)
        copy = runtime.new_cache(reader.capacity)
        tokens.append(int(runtime.prefill(copy, head[:reads] + tail).argmax()))
        shared.append(reader)
        copies.append(copy)
    decode_beside_copies(runtime, shared, copies, tokens, STEPS)
    assert all(c.prefix is prefix for c in shared)
    assert (len(calls) > 0) == (joined_factor > 0)
    if joined_factor > 0:  # the joined form never widens the prefix's values
        assert all(v.dtype == torch.bfloat16 for v in prefix.v)
