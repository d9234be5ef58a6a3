"""Store logic with no model: exact keys, hits, eviction order, pins, invariants, disk atomicity."""

from __future__ import annotations

import hashlib
import os
import struct

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
from semkv.store.keys import hash_fields, prefix_digests

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
    assert chunk_key(FP, [1, 2, 3]) != prompt_key(FP, [1, 2, 3])  # kind is part of the key
    assert chunk_key(FP, [1, 2, 3]) != chunk_key("e" * 64, [1, 2, 3])  # fingerprint is part of the key
    assert chunk_key(FP, [12, 3]) != chunk_key(FP, [1, 23])
    assert hash_fields("1") != hash_fields(1)  # str vs int never collide
    assert hash_fields(None) != hash_fields("") != hash_fields([])


# Today's keys, pinned: a drift in hashing orphans every entry already stored on disk or in Redis.
PINNED_KEYS = {
    "chunk": "425729f19fecbf91a83378dacbc6d82658232f9524973b687205b1d3c4a3fca9",
    "prompt": "009f83c147aa5d3ff082dba27a9702989374aa807bb362d5b5a0bbaa294951dc",
    "block0": "6fa98ae835a2b03c97a7859c61f5aa68428154bf924243d682ef0eb09b744899",
    "block1": "30a899254ca4aece11a0a2e1810a717b2ed425902511c1d7a87b202c00e89464",
    "fields": "1afa244c8a4318437c740dcdfa5d10579a48adcff0da169bc5e2f396fe675591",
    "digest0": "0beeb85c68d15099450d2d50b77ab76dd37609af0860c3a9e9b13efd54626369",
    "digest1": "7875e1bf52e3d2715db18da12fea9c2025532dd63f82e22431e0917fe5838b8b",
}


def test_keys_are_pinned():
    assert chunk_key(FP, [1, 2, 3]) == PINNED_KEYS["chunk"]
    assert prompt_key(FP, [1, 2, 3]) == PINNED_KEYS["prompt"]
    assert block_key(FP, 4, None, [0, 1, 2, 3]) == PINNED_KEYS["block0"]
    assert block_key(FP, 4, PINNED_KEYS["block0"], [4, 5, 6, 7]) == PINNED_KEYS["block1"]
    assert prefix_block_keys(FP, 4, list(range(10))) == [PINNED_KEYS["block0"], PINNED_KEYS["block1"]]
    assert hash_fields(1, "chunk", None, [], [-1, 2**40]) == PINNED_KEYS["fields"]
    assert prefix_digests(FP, 4, list(range(10))) == [PINNED_KEYS["digest0"], PINNED_KEYS["digest1"]]


def test_key_encoding_is_tagged_and_length_prefixed():
    """The byte layout behind the pins: tag, little-endian u64 length, body (ints as decimal text,
    token lists as little-endian int64)."""
    expected = hashlib.sha256(
        b"i" + struct.pack("<Q", 1) + b"1"
        + b"s" + struct.pack("<Q", 5) + b"chunk"
        + b"n" + struct.pack("<Q", 0)
        + b"t" + struct.pack("<Q", 16) + struct.pack("<2q", 7, -2)
    ).hexdigest()  # fmt: skip
    assert hash_fields(1, "chunk", None, [7, -2]) == expected


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


def block_entry(tokens: list[int], parent: str | None) -> KVEntry:
    """A prefix block of 2 tokens after ``parent`` (None: the first block of a chain)."""
    g = torch.Generator().manual_seed(sum(tokens))
    k, v = (torch.randn(2, 1, len(tokens), 4, generator=g).half() for _ in range(2))
    return KVEntry(block_key(FP, 2, parent, tokens), EntryKind.BLOCK, FP, tokens, k, v, 2, parent)


def test_memory_eviction_takes_the_leaves_of_a_prefix_chain_first():
    """Touching a block touches its ancestors: a chain is evicted leaf first, so a surviving block always
    has its whole prefix resident (a block without its parents could never be reused)."""
    root = block_entry([1, 2], None)
    mid = block_entry([3, 4], root.key)
    leaf = block_entry([5, 6], mid.key)
    other = entry([7, 8])
    size = root.nbytes
    assert other.nbytes == size
    tier = MemoryTier(budget_bytes=4 * size)
    for e in (root, mid, leaf, other):
        assert tier.put(e)
    assert tier.get(leaf.key) is leaf  # the chain is now more recent than `other`, its root most of all
    assert list(tier.keys()) == [other.key, leaf.key, mid.key, root.key]
    evicted = []
    for i in range(4):
        before = set(tier.keys())
        assert tier.put(entry([100 + i, 0]))
        evicted += [k for k in (other.key, leaf.key, mid.key, root.key) if k in before - set(tier.keys())]
    assert evicted == [other.key, leaf.key, mid.key, root.key]
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
    with pytest.raises(ValueError, match="cannot delete pinned entry"):
        tier.delete(a.key)
    tier.unpin(a.key)
    with pytest.raises(ValueError, match="that is not pinned"):
        tier.unpin(a.key)
    tier.check_invariants()


class CountingEntry(KVEntry):
    """A KVEntry that counts how often its size is read (how many entries an operation looked at)."""

    reads = 0

    @property
    def nbytes(self) -> int:
        CountingEntry.reads += 1
        return super().nbytes


def counting_entry(i: int) -> CountingEntry:
    base = entry([i, i + 1])
    return CountingEntry(base.key, base.kind, base.fingerprint, base.token_ids, base.k, base.v)


def test_put_into_a_full_tier_looks_at_the_victims_not_every_entry():
    """A full tier of 300 entries: each further put evicts one entry and must not read the size of every
    resident entry (the old code listed and summed all of them per put: O(entries) per write)."""
    size = entry([1, 2]).nbytes
    tier = MemoryTier(budget_bytes=300 * size)
    for i in range(300):
        assert tier.put(counting_entry(10 * i))
    assert tier.pin(next(iter(tier.keys())))  # a pinned entry at the LRU front is stepped over
    CountingEntry.reads = 0
    for i in range(300, 350):
        assert tier.put(counting_entry(10 * i))
    assert tier.stats.evictions == 50 and len(list(tier.keys())) == 300
    assert CountingEntry.reads <= 50 * 4, f"{CountingEntry.reads} size reads for 50 puts"
    tier.check_invariants()


def reference_put(order: list, sizes: dict, pins: dict, budget: int, key, size: int) -> bool:
    """The plain LRU rule the tier must follow: evict the oldest unpinned entries until ``size`` fits;
    refuse (evicting nothing) when even every unpinned entry would not make room."""
    if key in sizes:
        order.remove(key)
        order.append(key)
        return True
    used = sum(sizes.values())
    if size > budget:
        return False
    if used + size > budget:
        evictable = [k for k in order if not pins.get(k)]
        if used - sum(sizes[k] for k in evictable) + size > budget:
            return False
        for k in evictable:
            if used + size <= budget:
                break
            order.remove(k)
            used -= sizes.pop(k)
    order.append(key)
    sizes[key] = size
    return True


def test_memory_tier_matches_the_lru_rule_under_random_puts_gets_and_pins():
    """600 seeded random puts (mixed sizes), gets, pins and unpins: the tier's keys, order and answers
    equal a plain LRU model's after every operation, and its byte and pinned-byte counts stay exact."""
    rng = torch.Generator().manual_seed(7)
    pool = [entry(list(range(i, i + 1 + i % 4))) for i in range(0, 400, 10)]
    tier = MemoryTier(budget_bytes=6 * entry([1, 2]).nbytes)
    order: list = []
    sizes: dict = {}
    pins: dict = {}
    refused = 0
    for _ in range(600):
        op, pick = (int(x) for x in torch.randint(0, 1000, (2,), generator=rng))
        e = pool[pick % len(pool)]
        if op % 10 < 3 and e.key in sizes:
            assert tier.pin(e.key)
            pins[e.key] = pins.get(e.key, 0) + 1
        elif op % 10 == 3 and pins.get(e.key):
            tier.unpin(e.key)
            pins[e.key] -= 1
        elif op % 10 == 4:
            assert (tier.get(e.key) is not None) == (e.key in sizes)
            if e.key in sizes:
                order.remove(e.key)
                order.append(e.key)
        else:
            admitted = tier.put(e)
            assert admitted == reference_put(order, sizes, pins, tier.budget_bytes, e.key, e.nbytes)
            refused += not admitted
        assert list(tier.keys()) == order
        tier.check_invariants()
    assert refused > 0 and tier.stats.evictions > 0, (refused, tier.stats.evictions)  # both paths were taken


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
    """A put over the budget removes the least recently written files first, never the new one, down to
    the tier's low-water mark (``LOW_WATER`` of the budget)."""
    a, b, c, d = entry([1, 1]), entry([2, 2]), entry([3, 3]), entry([4, 4, 4, 4])
    size = len(encode(a))
    tier = DiskTier(tmp_path, budget_bytes=int(2 * size / DiskTier.LOW_WATER) + 1)  # low water: 2 entries
    for i, e in enumerate((a, b)):
        assert tier.put(e)
        os.utime(tier.path(e.key), ns=(i * 10**9, i * 10**9))  # a older than b
    assert tier.put(c)  # 3 entries > 2: the oldest (a) goes
    assert set(tier.keys()) == {b.key, c.key} and tier.stats.evictions == 1
    assert tier.nbytes() == 2 * size
    assert len(encode(d)) > size and tier.put(d)  # bigger: b and c both go to make room
    assert set(tier.keys()) == {d.key} and tier.stats.evictions == 3


def test_disk_budget_through_the_store_config(tmp_path, tokenizer):
    """``StoreConfig(disk_bytes=...)`` end to end: an engine's disk tier stays within its budget, keeps
    the latest prompt's blocks, and a fresh engine (a new process) reuses them; the oldest are gone."""
    from tests.conftest import tiny_hf_model
    from tests.reliability.reliability_helpers import engine_at

    model = tiny_hf_model("llama", len(tokenizer))
    # plain text (no shared template blocks), each prompt's first block its own
    prompts = [f"{i} prompts ago the committee met on Tuesday to review the budget." for i in range(4, 0, -1)]
    options = dict(max_new_tokens=1, use_chat_template=False)

    probe = engine_at(tmp_path / "probe", tokenizer, model)
    probe.generate(prompt=prompts[-1], reuse="none", **options)
    one_prompt = probe.store.tier("disk").nbytes()
    budget = int(1.5 * one_prompt)  # room for one prompt's blocks, not two

    home = tmp_path / "home"
    bounded = engine_at(home, tokenizer, model, disk_bytes=budget)
    for prompt in prompts:
        bounded.generate(prompt=prompt, reuse="none", **options)
        assert 0 < bounded.store.tier("disk").nbytes() <= budget
    assert bounded.store.tier("disk").stats.evictions > 0
    bounded.close()
    last = engine_at(home, tokenizer, model, disk_bytes=budget).generate(
        prompt=prompts[-1], reuse="prefix", **options
    )
    assert last.stats["path"] == "prefix" and last.stats["reused_tokens"] >= last.stats["prompt_tokens"] - 4
    first = engine_at(home, tokenizer, model, disk_bytes=budget).generate(
        prompt=prompts[0], reuse="prefix", **options
    )
    assert first.stats["reused_tokens"] == 0


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
    with pytest.raises(ValueError, match="does not match this store.s model"):
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
