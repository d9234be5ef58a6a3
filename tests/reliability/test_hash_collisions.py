"""Forced key collisions never serve another text's KV.

Injected: the key functions are monkeypatched to collide — (1) the prefix-block key ignores its
parent (so a block after a *different* prefix but with equal tokens gets the same key: the case the
token-id check alone cannot catch), (2) every block key is one constant, (3) keys truncated to one
hex digit (16 buckets) under a seeded random workload of 8 prompts built from shared sentences,
(4) chunk and prompt keys forced equal for different texts and kinds.

Must happen: every generation equals the cache-less run of the same prompt (tokens and first-token
logits); each collision is counted as a mismatch (a miss); the colliding entry is never returned.
Case (1) also shows the entry that collides *would* pass a token-ids-only check, so the independent
prefix digest is what stops it.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

import semkv.store.keys as keys_module
from semkv.store import DiskTier, KVStore, MemoryTier
from semkv.store.keys import EntryKey, EntryKind, prefix_block_keys
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import FP, engine_at, small_entry

# one token apart (a single letter): the blocks after the differing one hold equal token ids
PROMPT_A = "Q said: the quick brown fox jumps over the lazy dog and runs home."
PROMPT_B = "Z said: the quick brown fox jumps over the lazy dog and runs home."


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_hf_model("llama", len(tokenizer))


def reference(tmp_path, tokenizer, model, prompt: str, new_tokens: int = 3):
    engine = engine_at(tmp_path / "nocache", tokenizer, model, disk=False)
    return engine.generate(prompt, max_new_tokens=new_tokens, reuse="none", store_prompt=False)


def assert_same(g, ref):
    assert g.token_ids == ref.token_ids
    torch.testing.assert_close(g.first_logits, ref.first_logits, atol=1e-5, rtol=0)


def parentless_block_key(fingerprint, block_size, parent, token_ids, namespace=None):
    return keys_module.hash_fields(1, "block", fingerprint, block_size, None, list(token_ids))


def test_block_key_ignoring_the_prefix_is_caught_by_the_prefix_digest(
    tmp_path, tokenizer, model, monkeypatch
):
    refs = {p: reference(tmp_path, tokenizer, model, p) for p in (PROMPT_A, PROMPT_B)}
    monkeypatch.setattr(keys_module, "block_key", parentless_block_key)
    engine = engine_at(tmp_path / "home", tokenizer, model)
    ids_a = engine.layout(engine_request(PROMPT_A)).token_ids
    ids_b = engine.layout(engine_request(PROMPT_B)).token_ids
    keys_a = prefix_block_keys(engine.fingerprint, 4, ids_a)
    keys_b = prefix_block_keys(engine.fingerprint, 4, ids_b)
    first_diff = next(i for i, (a, b) in enumerate(zip(keys_a, keys_b, strict=False)) if a != b)
    assert keys_a[first_diff + 1] == keys_b[first_diff + 1]  # the forced collision after a different block

    assert_same(engine.generate(PROMPT_A, max_new_tokens=3), refs[PROMPT_A])
    assert_same(engine.generate(PROMPT_B, max_new_tokens=3), refs[PROMPT_B])  # stores B's differing block
    mismatches = engine.store.stats.mismatches
    g = engine.generate(PROMPT_B, max_new_tokens=3)
    assert_same(g, refs[PROMPT_B])
    assert g.stats["reused_tokens"] == (first_diff + 1) * 4  # stops at the colliding block
    assert engine.store.stats.mismatches > mismatches

    # the colliding entry holds the right token ids, fingerprint and kind: only the digest refuses it
    colliding = engine.store.tiers[0].get(keys_b[first_diff + 1])
    block = ids_b[(first_diff + 1) * 4 : (first_diff + 2) * 4]
    assert colliding is not None and colliding.token_ids == block
    assert engine.store.get(keys_b[first_diff + 1], block, EntryKind.BLOCK) is colliding
    digest = keys_module.prefix_digests(engine.fingerprint, 4, ids_b)[first_diff + 1]
    assert (
        engine.store.get(
            keys_b[first_diff + 1], block, EntryKind.BLOCK, expect_meta={"prefix_sha256": digest}
        )
        is None
    )

    # a fresh engine reading the same disk store is just as safe
    fresh = engine_at(tmp_path / "home", tokenizer, model)
    assert_same(fresh.generate(PROMPT_B, max_new_tokens=3), refs[PROMPT_B])


def engine_request(prompt: str):
    from semkv.request import GenerateRequest

    return GenerateRequest(prompt=prompt)


def test_every_block_key_equal(tmp_path, tokenizer, model, monkeypatch):
    prompts = [PROMPT_A, PROMPT_B, "Completely different words here, nothing shared at all."]
    refs = [reference(tmp_path, tokenizer, model, p, 1) for p in prompts]
    monkeypatch.setattr(keys_module, "block_key", lambda *args: EntryKey("0" * 64))
    engine = engine_at(tmp_path / "home", tokenizer, model)
    for _ in range(2):
        for prompt, ref in zip(prompts, refs, strict=True):
            assert_same(engine.generate(prompt, max_new_tokens=1), ref)
    assert engine.store.stats.mismatches > 0


def test_truncated_keys_random_workload(tmp_path, tokenizer, model, monkeypatch):
    """16 key buckets for every kind of entry; 8 seeded prompts, each served twice."""
    sentences = [
        "The fox runs.",
        "A dog sleeps under the tree.",
        "Rain falls on the quiet town.",
        "Birds sing at dawn.",
        "The river is cold.",
    ]
    rng = random.Random(42)
    prompts = [" ".join(rng.choice(sentences) for _ in range(rng.randint(2, 5))) for _ in range(8)]
    refs = {p: reference(tmp_path, tokenizer, model, p, 1) for p in set(prompts)}
    real_hash = keys_module.hash_fields

    def truncated(*fields):
        return EntryKey(real_hash(*fields)[0] * 64)

    monkeypatch.setattr(keys_module, "hash_fields", truncated)
    engine = engine_at(tmp_path / "home", tokenizer, model, memory_bytes=1 << 20)
    served = 0
    for prompt in prompts + prompts[::-1]:
        assert_same(engine.generate(prompt, max_new_tokens=1), refs[prompt])
        served += 1
    print(
        f"\n[collisions] {served} generations over 16 key buckets, {engine.store.stats.mismatches} collisions refused"
    )
    assert engine.store.stats.mismatches > 0


@pytest.mark.parametrize("disk", [False, True])
def test_chunk_and_prompt_key_collisions_at_the_store(tmp_path, disk):
    tiers = [MemoryTier(1 << 20)] + ([DiskTier(tmp_path / "store")] if disk else [])
    store = KVStore(tiers, FP)
    shared = EntryKey(hashlib.sha256(b"collide").hexdigest())
    first = small_entry([1, 2, 3])
    first.key = shared
    store.put(first)
    other = small_entry([4, 5, 6])
    assert store.get(shared, [4, 5, 6], EntryKind.CHUNK) is None  # other tokens under the same key
    assert store.get(shared, [1, 2, 3], EntryKind.PROMPT) is None  # right tokens, wrong kind
    assert store.stats.mismatches == 2 * len(tiers)
    other.key = shared
    store.put(other)  # never replaces the entry already there
    got = store.get(shared, [1, 2, 3], EntryKind.CHUNK)
    assert got is not None and torch.equal(got.k, first.k)
    assert store.get(shared, [4, 5, 6], EntryKind.CHUNK) is None
