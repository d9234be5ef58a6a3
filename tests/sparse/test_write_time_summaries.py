"""Block summaries are computed once per block, and travel with stored prefix blocks.

Injected: prefills through the engine (full and prefix-hit), decodes that complete blocks, a stored
prefix whose blocks carry no summaries, and summaries of another shape. Must happen: the first token waits
for no summary (the sparse decoder is set up before the first decode step); that set-up summarises every
complete prompt block once (exactly as a direct computation from the cache rows) and the decoder's steps
summarise no prompt block again; a block completed by decode is summarised at the next step; a prefix hit
takes the stored blocks' summaries instead of recomputing them (bit for bit those of a fresh prefill);
blocks stored without summaries, or with misshapen ones, are summarised from their rows.
"""

from __future__ import annotations

import pytest
import torch

from semkv.request import GenerateRequest
from semkv.reuse.prefix import SUMMARY_EXTRA
from semkv.sparse import POLICIES
from semkv.sparse.index import CHUNK_BLOCKS, SUMMARY_KINDS, BlockIndex
from semkv.store.keys import prefix_block_keys

BLOCK = 4
PROMPT = " ".join(f"item {i} costs {i * 3 % 17} coins." for i in range(30))


def _request(**kw) -> GenerateRequest:
    options = dict(prompt=PROMPT, max_new_tokens=12, stop_at_eos=False, sparse="keykey", kv_budget=0.2)
    options.update(kw)
    return GenerateRequest(**options)


def direct_summaries(cache, block_size: int, blocks: int) -> dict[str, torch.Tensor]:
    """Every summary kind of blocks [0, blocks), straight from the cache rows (float32, KV dtype rounded)."""
    rows = blocks * block_size
    pre = torch.stack([k[:, :rows] for k in cache.k_pre]).float()
    rot = torch.stack([k[:, :rows] for k in cache.k_rot]).float()
    shape = (*pre.shape[:2], blocks, block_size, pre.shape[-1])
    pre, rot = pre.view(shape), rot.view(shape)
    out = {
        "mean": pre.mean(dim=3),
        "sq": pre.square().mean(dim=(3, 4)),
        "min": rot.amin(dim=3),
        "max": rot.amax(dim=3),
        "rmean": rot.mean(dim=3),
    }
    return {k: v.to(cache.kv_dtype).float() for k, v in out.items()}


def assert_index_matches_cache(index: BlockIndex) -> None:
    expected = direct_summaries(index.cache, index.block_size, index.num_complete)
    for kind in SUMMARY_KINDS:
        torch.testing.assert_close(index.summary(kind), expected[kind], msg=kind)
    rmean = expected["rmean"]  # chunks: means of CHUNK_BLOCKS consecutive blocks (the last may be short)
    chunks = [rmean[:, :, c : c + CHUNK_BLOCKS].mean(2) for c in range(0, rmean.shape[2], CHUNK_BLOCKS)]
    torch.testing.assert_close(index.chunk_means(), torch.stack(chunks, dim=2))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_set_up_summarises_every_prompt_block_once_after_the_first_token(make_tiny_engine, family):
    engine = make_tiny_engine(family, block_size=BLOCK, kv_dtype="float16")
    seq = engine.prefill(_request(reuse="none"))
    index = seq.blocks
    assert index is not None and seq.sparse is not None and seq.sparse.index is None
    assert index.num_complete == 0, "the first token must wait for no summary"
    engine.decode_step(seq)  # the decoder is set up on the summarised prompt, then decodes
    assert seq.sparse.index is index and index.num_complete == seq.prompt_tokens // BLOCK
    assert index.computed_blocks == seq.prompt_tokens // BLOCK, "a decode step summarised a prompt block"
    assert_index_matches_cache(index)
    # decode until blocks complete: each is summarised at the step after it is written
    engine.decode(seq)
    assert index.num_complete == (seq.cache.length - 1) // BLOCK > seq.prompt_tokens // BLOCK
    assert_index_matches_cache(index)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"dense"}))
def test_no_policy_summarises_at_the_first_step(make_tiny_engine, policy):
    """Every policy starts from the set-up's summaries: its first decode step summarises no block again."""
    engine = make_tiny_engine("llama", block_size=BLOCK, kv_dtype="float16")
    seq = engine.prefill(_request(reuse="none", sparse=policy))
    engine.decode_step(seq)
    assert seq.sparse.index is seq.blocks and seq.blocks.computed_blocks == seq.prompt_tokens // BLOCK


def test_prefix_hit_takes_the_stored_summaries(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=BLOCK, kv_dtype="float16")
    first = engine.prefill(_request(reuse="none"))
    engine.store_prefill(first)
    keys = prefix_block_keys(engine.fingerprint, BLOCK, first.layout.token_ids)
    stored = engine.store.get(keys[0])
    assert stored is not None and {SUMMARY_EXTRA + k for k in SUMMARY_KINDS} <= set(stored.extras)
    second = engine.prefill(_request(reuse="prefix"))
    assert second.outcome.path == "prefix"
    engine.decode_step(second)  # the sparse set-up inserts the carried summaries, computes the rest
    index = second.blocks
    carried = second.outcome.reused_tokens // BLOCK
    assert carried >= 2 and index.computed_blocks == index.num_complete - carried
    for kind in SUMMARY_KINDS:  # bit for bit a fresh prefill's
        assert torch.equal(index.summary(kind), first.blocks.summary(kind)), kind


def test_blocks_stored_without_summaries_are_summarised(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=BLOCK, kv_dtype="float16")
    first = engine.prefill(_request(reuse="none"))
    keys = prefix_block_keys(engine.fingerprint, BLOCK, first.layout.token_ids)
    first.outcome.summaries = None  # an older writer: blocks without summaries
    engine.store_prefill(first)
    assert not engine.store.get(keys[0]).extras
    second = engine.prefill(_request(reuse="prefix"))
    assert second.outcome.path == "prefix"
    engine.decode_step(second)
    assert second.blocks.computed_blocks == second.blocks.num_complete
    assert_index_matches_cache(second.blocks)


def test_misshapen_stored_summaries_are_recomputed(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=BLOCK, kv_dtype="float16")
    first = engine.prefill(_request(reuse="none"))
    engine.decode_step(first)
    index = first.blocks
    with pytest.raises(ValueError, match="mean"):
        index.insert({k: v[..., :1] for k, v in index.block_summaries(0).items()})
    assert index.num_complete == first.prompt_tokens // BLOCK  # nothing appended


def test_fork_copies_the_summaries(make_tiny_engine):
    """A fork's decode extends its own copy; the original's summaries stay as they were."""
    engine = make_tiny_engine("llama", block_size=BLOCK, kv_dtype="float16")
    base = engine.prefill(_request(reuse="none", sparse=None))
    fork = engine.fork(base, sparse="keykey", kv_budget=0.2)
    before = base.blocks.num_complete
    assert before == base.prompt_tokens // BLOCK
    assert fork.blocks is not base.blocks and fork.sparse.index is fork.blocks
    engine.decode(fork)
    assert fork.blocks.num_complete > before == base.blocks.num_complete
    assert_index_matches_cache(fork.blocks)


def test_dense_request_summarises_after_its_first_token(make_tiny_engine):
    """A dense request's TTFT holds no block summarising: its prompt blocks are summarised when its prompt
    is stored (so the stored blocks still carry summaries) or when it is forked into a sparse decode."""
    engine = make_tiny_engine("llama", block_size=BLOCK, kv_dtype="float16")
    seq = engine.prefill(_request(reuse="none", sparse=None))
    assert seq.sparse is None and seq.blocks is not None
    assert seq.blocks.num_complete == 0 and seq.summarise_s < 0.05
    engine.decode_step(seq)
    fork = engine.fork(seq, sparse="keykey", kv_budget=0.2)
    assert fork.blocks.num_complete == seq.blocks.num_complete == seq.prompt_tokens // BLOCK
    assert_index_matches_cache(fork.blocks)
    engine.store_prefill(seq)
    keys = prefix_block_keys(engine.fingerprint, BLOCK, seq.layout.token_ids)
    stored = engine.store.get(keys[-1])
    assert stored is not None and {SUMMARY_EXTRA + k for k in SUMMARY_KINDS} <= set(stored.extras)
    second = engine.prefill(_request(reuse="prefix"))
    assert second.outcome.path == "prefix" and second.blocks.computed_blocks == 0
    for kind in SUMMARY_KINDS:  # carried from the store, bit for bit
        assert torch.equal(
            second.blocks.summary(kind), seq.blocks.summary(kind)[:, :, : second.blocks.num_complete]
        )


def test_dense_request_stores_summaries_without_a_fork(make_tiny_engine):
    """Storing a dense request's prompt summarises its blocks first: the stored blocks carry summaries."""
    engine = make_tiny_engine("llama", block_size=BLOCK, kv_dtype="float16")
    seq = engine.prefill(_request(reuse="none", sparse=None))
    engine.store_prefill(seq)
    assert seq.blocks.num_complete == seq.prompt_tokens // BLOCK
    assert_index_matches_cache(seq.blocks)
    keys = prefix_block_keys(engine.fingerprint, BLOCK, seq.layout.token_ids)
    assert {SUMMARY_EXTRA + k for k in SUMMARY_KINDS} <= set(engine.store.get(keys[0]).extras)
