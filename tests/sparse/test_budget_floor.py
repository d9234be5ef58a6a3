"""The budget's floor (``SparseConfig.min_kept_tokens``) protects short contexts.

Injected: budgets of 10% over short contexts with and without a floor; bad floors; a tiny Llama engine
decoding a short prompt with Key-Key at 10%, once with a floor of 32 tokens and once with a floor
that covers every candidate block.
Must happen: the blocks a step keeps are the larger of the fraction's and the floor's (rounded up to
whole blocks); a bad floor is a ValueError naming ``min_kept_tokens``; the engine's decoder keeps at
least the floor's blocks each step and reports the floor in its stats; a floor covering every candidate
decodes exactly as dense (the same tokens).
"""

from __future__ import annotations

import pytest

from semkv.request import GenerateRequest
from semkv.sparse import Budget, SparseConfig

PROMPT = " ".join(f"Entry {i} of the ledger reads {i * 37 % 101} coins." for i in range(10))


def test_blocks_take_the_larger_of_fraction_and_floor():
    assert Budget(0.1).blocks(320, 16) == 2  # 32 tokens
    assert Budget(0.1, min_tokens=64).blocks(320, 16) == 4
    assert Budget(0.1, min_tokens=70).blocks(320, 16) == 5  # rounded up to whole blocks
    assert Budget(0.1, min_tokens=64).blocks(8192, 16) == 52  # long contexts: the fraction
    assert Budget(40, min_tokens=64).blocks(8192, 16) == 4  # a token count is floored too
    assert SparseConfig(kv_budget=0.1, min_kept_tokens=64).budget.blocks(320, 16) == 4


@pytest.mark.parametrize("floor", [-1, 1.5, True, "8"])
def test_bad_floor(floor):
    with pytest.raises(ValueError, match="min_kept_tokens"):
        SparseConfig(kv_budget=0.1, min_kept_tokens=floor)


def _generate(engine, decoder=None, **config):
    request = GenerateRequest(
        prompt=PROMPT, max_new_tokens=6, stop_at_eos=False, store_prompt=False, reuse="none", sparse=None
    )
    base = engine.prefill(request)
    seq = engine.fork(base, sparse=engine.sparse_decoder("keykey", 0.1, **config) if config else None)
    for _ in range(5):
        engine.decode_step(seq)
    if seq.sparse is not None:
        seq.sparse.finish()
    return seq


def test_engine_decoder_keeps_the_floor(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    seq = _generate(engine, min_kept_tokens=32)
    records = seq.sparse.records
    assert records and all(len(r.selected[0]) == 8 for r in records)
    assert seq.sparse.stats()["sparse_min_kept_tokens"] == 32
    plain = _generate(engine, min_kept_tokens=0)
    assert all(len(r.selected[0]) < 8 for r in plain.sparse.records)  # 10% alone keeps fewer
    assert all(r.loaded_blocks > 0 for r in plain.sparse.records[:1])  # it really selects


def test_floor_covering_every_candidate_decodes_dense(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    covered = _generate(engine, min_kept_tokens=4096)
    dense = _generate(engine)
    assert covered.tokens == dense.tokens
    assert all(r.loaded_blocks == 0 for r in covered.sparse.records)  # the dense path: nothing gathered
