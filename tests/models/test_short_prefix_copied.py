"""Readers of a short shared prefix copy it in before they decode together.

Injected: four caches that read the first 8 rows of a pooled prompt (as requests behind one chat template
read its pooled system prompt) and hold 36-45 rows of their own, decoding together in bf16; beside them,
the same with a prefix as long as their own rows.

Must happen: the short prefix (at most ``SHORT_PREFIX_SHARE`` of a reader's own rows) is copied into every
reader at the first batched step (no reader holds it after), and the greedy tokens and logits equal those
of caches that held their own copy from the start; readers of the long prefix keep reading it.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime
from semkv.models.runtime import SHORT_PREFIX_SHARE
from tests.models.test_joined_decode import decode_beside_copies
from tests.models.test_shared_prefix import _prefix_of, _runtime

STEPS = 4


def _readers(runtime: Runtime, vocab: int, prefix_rows: int, tails: tuple[int, ...]):
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(3, vocab, (prefix_rows,), generator=gen).tolist()
    prefix = _prefix_of(runtime, head)
    readers, copies, tokens = [], [], []
    for length in tails:
        tail = torch.randint(3, vocab, (length,), generator=gen).tolist()
        reader = runtime.new_cache(prefix_rows + length + STEPS + 1)
        reader.share_prefix(prefix, prefix_rows)
        runtime.prefill(reader, tail)
        copy = runtime.new_cache(reader.capacity)
        tokens.append(int(runtime.prefill(copy, head + tail).argmax()))
        readers.append(reader)
        copies.append(copy)
    return prefix, readers, copies, tokens


@pytest.mark.parametrize("prefix_rows, copied", [(8, True), (40, False)])
def test_a_short_prefix_is_copied_in_a_long_one_stays_shared(tokenizer, prefix_rows, copied):
    runtime = _runtime("llama", len(tokenizer), torch.bfloat16)
    tails = (36, 40, 45, 38)
    assert (prefix_rows <= SHORT_PREFIX_SHARE * min(tails)) == copied
    prefix, readers, copies, tokens = _readers(runtime, len(tokenizer), prefix_rows, tails)

    def copied_as_expected() -> None:
        assert all((r.prefix is None) == copied for r in readers)

    decode_beside_copies(runtime, readers, copies, tokens, STEPS, after_step=copied_as_expected)
    assert (len(prefix.holders) == 0) == copied
