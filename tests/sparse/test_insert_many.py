"""Stored block summaries enter a block index in one write per kind (a prefix hit's blocks at once).

Injected: the summaries of a cache's blocks handed to a fresh index in one call, once all valid and once
with a misshapen block in the middle. Must happen: the same summaries and chunk means as inserting block
by block; with the bad block, the blocks before it are inserted and a ValueError names the problem.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.sparse.index import SUMMARY_KINDS, BlockIndex
from tests.conftest import tiny_hf_model

BLOCK = 4


def _summarised() -> tuple[Runtime, BlockIndex]:
    model = tiny_hf_model("llama", 97)
    runtime = Runtime(adapter_for(model.config.model_type)(model), torch.bfloat16, torch.float32)
    cache = runtime.new_cache(64)
    prompt = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    runtime.prefill(cache, prompt)
    index = BlockIndex(cache, BLOCK)
    index.add_blocks()
    return runtime, index


def test_many_blocks_at_once_equal_one_by_one():
    _, source = _summarised()
    blocks = [source.block_summaries(b) for b in range(source.num_complete)]
    one, many = BlockIndex(source.cache, BLOCK), BlockIndex(source.cache, BLOCK)
    for summaries in blocks:
        one.insert(summaries)
    assert many.insert_many(blocks) == len(blocks) == many.num_complete
    for kind in SUMMARY_KINDS:
        assert torch.equal(one.summary(kind), many.summary(kind))
    assert torch.equal(one.chunk_means(), many.chunk_means())


def test_a_misshapen_block_stops_the_insert_after_the_valid_ones():
    _, source = _summarised()
    blocks = [source.block_summaries(b) for b in range(source.num_complete)]
    blocks[3] = {k: v[..., :1] for k, v in blocks[3].items()}
    index = BlockIndex(source.cache, BLOCK)
    with pytest.raises(ValueError, match="missing or not of shape"):
        index.insert_many(blocks)
    assert index.num_complete == 3
    assert torch.equal(index.summary("mean"), source.summary("mean")[:, :, :3])
