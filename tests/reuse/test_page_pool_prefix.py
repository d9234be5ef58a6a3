"""Exact prefix reuse through the page pool, on tiny models.

Injected: prompts that share a prefix, served with the pool (the default), without it, after the store
lost the blocks, across tenants on a pool too small for both, after ``delete_stored``, and with every
page held. Must happen: a pool hit loads the same rows bit for bit as full prefill and the same logits
as a store hit; each tenant reaches only its own pages, and a page handed from one tenant to another
holds the new tenant's rows; deleted entries are no longer hit; a pool with no free page serves the
request from the store and keeps nothing.
"""

from __future__ import annotations

import torch

from semkv.request import GenerateRequest
from semkv.reuse.prefix import PrefixKeys
from semkv.store.keys import Namespace

DOC = " ".join(f"Line {i} says the value of item {i} is {i * 7 % 13}." for i in range(30))


def request(question: str, **options) -> GenerateRequest:
    return GenerateRequest(prompt=DOC + question, max_new_tokens=6, stop_at_eos=False, **options)


def assert_rows_equal(a, b, rows: int) -> None:
    for layer in range(len(a.k_pre)):
        for name in ("k_pre", "k_rot", "v"):
            got, want = getattr(a, name)[layer][:, :rows], getattr(b, name)[layer][:, :rows]
            assert torch.equal(got, want), (layer, name)


def test_a_pool_hit_is_exact_and_matches_a_store_hit(make_tiny_engine, device):
    engine = make_tiny_engine("llama", kv_dtype="float16", compute_dtype="bfloat16", device=device)
    engine.generate(**vars(request(" Which item is 3?")) | {"max_new_tokens": 2})
    pooled = engine.prefill(request(" Which item is 5?"))
    info = pooled.outcome.info
    assert pooled.outcome.path == "prefix" and info["pooled_blocks"] == info["prefix_blocks"] > 10
    fresh = engine.prefill(request(" Which item is 5?", reuse="none", store_prompt=False))
    rows = pooled.outcome.reused_tokens
    assert_rows_equal(pooled.cache, fresh.cache, rows)

    engine.drop_page_pool()  # the same hit from the store's memory tier
    stored = engine.prefill(request(" Which item is 5?", store_prompt=False))
    assert stored.outcome.info["pooled_blocks"] == 0 and stored.outcome.reused_tokens == rows
    assert_rows_equal(pooled.cache, stored.cache, rows)
    assert torch.equal(pooled.first_logits, stored.first_logits)


def test_store_blocks_are_promoted_into_the_pool(make_tiny_engine):
    engine = make_tiny_engine("qwen2", block_size=4)
    engine.generate(**vars(request(" A?")))
    engine.drop_page_pool()
    first = engine.generate(**vars(request(" B?")))
    assert first.stats["path"] == "prefix"
    again = engine.prefill(request(" C?"))
    assert again.outcome.info["pooled_blocks"] == again.outcome.info["prefix_blocks"] > 0


def test_tenants_reach_only_their_own_pages_and_a_reused_page_holds_the_new_rows(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    prompt_tokens = len(engine.resolve(request(" Q?")).token_ids)
    blocks = prompt_tokens // 4
    pool = engine.runtime.attach_page_pool(4, (blocks + 2) * engine.runtime.page_pool.layout.page_bytes)
    assert pool is not None and pool.num_pages == blocks + 2  # room for one tenant's prompt only

    engine.generate(**vars(request(" Q?", tenant="alice")))
    alice_keys = PrefixKeys.of(
        engine.fingerprint, 4, engine.resolve(request(" Q?")).token_ids, Namespace("alice")
    )
    assert all(pool.table.lookup(k) is not None for k in alice_keys.keys)

    bob = engine.prefill(request(" Q?", tenant="bob"))
    assert bob.outcome.path == "full"  # alice's pages are not bob's
    engine.store_prefill(bob)  # bob's blocks take alice's pages, least recently used first
    assert pool.table.evictions >= blocks - 2
    bob_again = engine.prefill(request(" R?", tenant="bob"))
    assert bob_again.outcome.info["pooled_blocks"] > 0
    fresh = engine.prefill(request(" R?", tenant="bob", reuse="none", store_prompt=False))
    assert_rows_equal(bob_again.cache, fresh.cache, bob_again.outcome.reused_tokens)
    pool.table.check_invariants()


def test_deleted_entries_are_not_hit_from_the_pool(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    engine.generate(**vars(request(" A?")))
    keys = engine.resolve(request(" A?")).prefix_keys
    engine.delete_stored(list(keys))
    again = engine.prefill(request(" B?", store_prompt=False))
    assert again.outcome.path == "full"
    assert engine.page_pool_stats()["indexed"] == 0


def test_a_pool_with_every_page_held_serves_from_the_store_and_keeps_nothing(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    pool = engine.runtime.attach_page_pool(4, 3 * engine.runtime.page_pool.layout.page_bytes)
    assert pool is not None
    engine.generate(**vars(request(" A?")))  # three pages kept, the rest only in the store
    lease = pool.lease([0, 1, 2])  # every page held by someone
    outcome = engine.prefill(request(" B?")).outcome
    assert outcome.path == "prefix" and outcome.info["pooled_blocks"] == 3
    seq = engine.prefill(request(" C?"))
    engine.store_prefill(seq)  # nothing to evict: the blocks stay in the store only
    assert engine.page_pool_stats()["indexed"] == 3
    lease.release()
    pool.table.check_invariants()


def test_no_pool_when_its_size_is_zero(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    engine_off = engine.twin(page_pool_bytes=0)
    assert engine_off.runtime.page_pool is None and engine_off.page_pool_stats() == {}
    engine_off.generate(**vars(request(" A?")))
    again = engine_off.prefill(request(" B?"))
    assert again.outcome.path == "prefix" and again.outcome.info["pooled_blocks"] == 0


def test_the_schedulers_cached_prefix_estimate_counts_blocks_only_the_pool_holds(make_tiny_engine):
    """Injected: the store loses a prompt's blocks that the pool still holds. Must happen: the scheduler's
    estimate of the tokens a request would load still counts them (the hit will come from the pool)."""
    engine = make_tiny_engine("llama", block_size=4)
    engine.generate(**vars(request(" A?")))
    admission = engine.admission(request(" A?"))
    before = engine.cached_prompt_tokens(admission)
    assert before > 0
    for key in admission.prefix_keys:
        engine.store.delete(key)  # from the store only, not through delete_stored
    assert engine.cached_prompt_tokens(admission) == before
    assert engine.prefill(request(" A?", reuse="prefix")).outcome.reused_tokens == before
