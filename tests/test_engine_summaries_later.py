"""A dense prefix hit's first token waits for no block summaries; storing its prompt gets them all.

Injected: a tiny engine (4-token blocks; the hit's blocks come with the summaries stored beside them);
a prompt stored, then the same prompt again as a dense prefix hit, and as a sparse one.

Must happen: the dense hit's block index holds no summarised block at its first token (the carried
summaries are kept aside, not inserted); once its prompt is stored, every prompt block is summarised, with
the summaries that summarising the cache's rows gives (the carried ones inserted, the rest computed); a
sparse hit's first token waits for none either (its decoder is not set up yet), and its first decode step
starts with every prompt block summarised and the decoder on that index.
"""

from __future__ import annotations

import torch

from semkv.request import GenerateRequest
from semkv.sparse.index import SUMMARY_KINDS, BlockIndex

PROMPT = "The ferry to the outer islands leaves at dawn and returns after the tide turns. " * 4


def _engine(make_tiny_engine):
    return make_tiny_engine("llama", block_size=4, disk=False)


def test_a_dense_hit_summarises_its_blocks_only_when_they_are_needed(make_tiny_engine):
    engine = _engine(make_tiny_engine)
    engine.generate(prompt=PROMPT, max_new_tokens=1)  # stores the prompt's blocks with their summaries
    seq = engine.prefill(GenerateRequest(prompt=PROMPT, reuse="prefix", max_new_tokens=2))
    assert seq.outcome.reused_tokens > 0
    assert seq.blocks is not None and seq.blocks.num_complete == 0
    engine.store_prefill(seq)
    prompt_blocks = len(seq.layout) // 4
    assert seq.blocks.num_complete == prompt_blocks
    fresh = BlockIndex(seq.cache, 4)
    fresh.add_blocks(prompt_blocks)
    for kind in SUMMARY_KINDS:
        torch.testing.assert_close(seq.blocks.summary(kind), fresh.summary(kind), atol=1e-2, rtol=1e-2)


def test_a_sparse_hit_starts_with_every_prompt_block_summarised(make_tiny_engine):
    engine = _engine(make_tiny_engine)
    engine.generate(prompt=PROMPT, max_new_tokens=1)
    seq = engine.prefill(
        GenerateRequest(prompt=PROMPT, reuse="prefix", sparse="keykey", kv_budget=0.5, max_new_tokens=2)
    )
    assert seq.outcome.reused_tokens > 0
    assert seq.blocks is not None and seq.blocks.num_complete == 0 and seq.sparse.index is None
    engine.decode_step(seq)
    assert seq.blocks.num_complete == len(seq.layout) // 4 and seq.sparse.index is seq.blocks
