"""Store logic with no model: exact keys, hits, eviction order, pins, invariants, disk atomicity."""

from __future__ import annotations

import os

import pytest
import torch

from semkv.store import (
    DiskTier,
    EntryKind,
    KVEntry,
    KVStore,
    MemoryTier,
    block_key,
    chunk_key,
    decode,
    encode,
    prefix_block_keys,
    prompt_key,
)
from semkv.store.entry import CorruptEntry
from semkv.store.keys import hash_fields

FP = "f" * 64


def entry(tokens: list[int], kind: EntryKind = EntryKind.CHUNK, fp: str = FP, layers: int = 2) -> KVEntry:
    """A tiny entry: 2 layers, 1 KV head, d=4, fp16 -> 2*2*1*n*4*2 bytes."""
    n = len(tokens)
    g = torch.Generator().manual_seed(sum(tokens) + n)
    k = torch.randn(layers, 1, n, 4, generator=g).half()
    v = torch.randn(layers, 1, n, 4, generator=g).half()
    key = chunk_key(fp, tokens) if kind == EntryKind.CHUNK else prompt_key(fp, tokens)
    return KVEntry(key, kind, fp, tokens, k, v)


def test_keys_are_typed_and_stable():
    assert chunk_key(FP, [1, 2, 3]) == chunk_key(FP, [1, 2, 3])
    assert chunk_key(FP, [1, 2, 3]) != prompt_key(FP, [1, 2, 3])  # kind is part of the key
    assert chunk_key(FP, [1, 2, 3]) != chunk_key("e" * 64, [1, 2, 3])  # fingerprint is part of the key
    assert chunk_key(FP, [12, 3]) != chunk_key(FP, [1, 23])
    assert hash_fields("1") != hash_fields(1)  # str vs int never collide
    # a pinned value: the key function must not drift silently between versions
    assert chunk_key(FP, [1, 2, 3]) == hash_fields(1, "chunk", FP, [1, 2, 3])


def test_prefix_block_keys_chain_and_skip_partial_block():
    keys = prefix_block_keys(FP, 4, list(range(10)))
    assert len(keys) == 2  # the trailing 2 tokens form no full block
    assert keys[0] == block_key(FP, 4, None, [0, 1, 2, 3])
    assert keys[1] == block_key(FP, 4, keys[0], [4, 5, 6, 7])
    # the same block after a different prefix has a different key
    other = prefix_block_keys(FP, 4, [9, 9, 9, 9, 4, 5, 6, 7])
    assert other[1] != keys[1]
    # block size is part of the key
    assert prefix_block_keys(FP, 2, [0, 1, 2, 3])[0] != block_key(FP, 4, None, [0, 1, 2, 3])


def test_codec_roundtrip_and_damage_detection():
    e = entry([5, 6, 7])
    e.extras["summary"] = torch.arange(4.0)
    e.meta["text"] = "hello"
    data = encode(e)
    back = decode(data)
    assert back.key == e.key and back.token_ids == [5, 6, 7] and back.meta == {"text": "hello"}
    assert (
        torch.equal(back.k, e.k)
        and torch.equal(back.v, e.v)
        and torch.equal(back.extras["summary"], e.extras["summary"])
    )
    flipped = bytearray(data)
    flipped[-3] ^= 0x01
    with pytest.raises(CorruptEntry, match="checksum"):
        decode(bytes(flipped))
    with pytest.raises(CorruptEntry):
        decode(data[: len(data) // 2])
    with pytest.raises(CorruptEntry, match="magic"):
        decode(b"XX" + data[2:])


def test_memory_lru_eviction_order_exact():
    one = entry([1, 2])  # 2*1*2*4*2 bytes * 2 (k,v) = 64 bytes
    size = one.nbytes
    tier = MemoryTier(budget_bytes=3 * size)
    a, b, c, d = (entry([i, i + 1]) for i in (10, 20, 30, 40))
    for e in (a, b, c):
        assert tier.put(e)
    assert tier.get(a.key) is a  # a becomes most recent: order b, c, a
    assert tier.put(d)  # evicts b (least recently used)
    assert list(tier.keys()) == [c.key, a.key, d.key]
    assert tier.stats.evictions == 1 and tier.nbytes() == 3 * size
    tier.check_invariants()


def test_pinned_entries_are_never_evicted():
    size = entry([1, 2]).nbytes
    tier = MemoryTier(budget_bytes=2 * size)
    a, b, c = (entry([i, i + 1]) for i in (10, 20, 30))
    tier.put(a)
    tier.put(b)
    assert tier.pin(a.key) and tier.pin(b.key)
    assert not tier.put(c)  # cannot fit without evicting pinned entries: not admitted
    assert list(tier.keys()) == [a.key, b.key]
    tier.unpin(b.key)
    assert tier.put(c)  # now b is evictable
    assert list(tier.keys()) == [a.key, c.key]
    assert tier.pin_count(a.key) == 1
    with pytest.raises(ValueError):
        tier.delete(a.key)
    tier.unpin(a.key)
    with pytest.raises(ValueError):
        tier.unpin(a.key)
    tier.check_invariants()


def test_disk_tier_roundtrip_sweep_and_quarantine(tmp_path):
    tier = DiskTier(tmp_path)
    e = entry([3, 4, 5])
    assert tier.put(e)
    assert tier.path(e.key).exists()
    assert tier.get(e.key).token_ids == [3, 4, 5]
    # a leftover temp file of a killed writer is swept at start
    leftover = tier.path(e.key).parent / f"{DiskTier.TMP_PREFIX}{e.key}.123.456"
    leftover.write_bytes(b"partial")
    again = DiskTier(tmp_path)
    assert again.swept == 1 and not leftover.exists()
    # a damaged file is a counted miss and is moved to quarantine
    path = again.path(e.key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert again.get(e.key) is None
    assert again.stats.corrupt == 1 and not path.exists()
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    assert list(again.keys()) == []


def test_disk_budget_removes_oldest(tmp_path):
    a, b, c = entry([1, 1]), entry([2, 2]), entry([3, 3])
    size = len(encode(a))
    tier = DiskTier(tmp_path, budget_bytes=2 * size)
    for i, e in enumerate((a, b, c)):
        tier.put(e)
        os.utime(tier.path(e.key), ns=(i * 10**9, i * 10**9))
        tier._enforce_budget(keep=tier.path(e.key))
    assert set(tier.keys()) == {b.key, c.key}


def test_store_read_through_promotes_and_checks_ownership(tmp_path):
    disk = DiskTier(tmp_path)
    memory = MemoryTier(10_000)
    store = KVStore([memory, disk], FP)
    e = entry([7, 8, 9])
    disk.put(e)  # only on disk
    assert e.key not in memory
    got = store.get(e.key, [7, 8, 9], EntryKind.CHUNK)
    assert got is not None and e.key in memory  # promoted
    assert store.stats.hits == 1
    # wrong token ids under the right key: a miss, never the entry
    assert store.get(e.key, [7, 8, 10]) is None
    assert store.stats.mismatches == 2  # both tiers hold it, both refused
    # wrong kind: a miss
    assert store.get(e.key, None, EntryKind.PROMPT) is None
    # an entry of another model is refused on put and on get
    foreign = entry([1, 2, 3], fp="0" * 64)
    with pytest.raises(ValueError):
        store.put(foreign)
    disk.put(foreign)
    assert store.get(foreign.key) is None
    memory.check_invariants()


def test_store_write_through_and_pinned_context(tmp_path):
    disk = DiskTier(tmp_path)
    memory = MemoryTier(10_000)
    store = KVStore([memory, disk], FP)
    e = entry([1, 2, 3])
    store.put(e)
    assert e.key in memory and e.key in disk
    with store.pinned([e.key]):
        assert memory.pin_count(e.key) == 1
    assert memory.pin_count(e.key) == 0
    summary = store.summary()
    assert summary["tiers"]["disk"]["entries"] == 1
