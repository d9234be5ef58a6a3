"""Several processes sharing one Redis and one disk folder: no torn reads, every read exact.

Injected: 4 forked processes, each with its own store (memory + the shared disk folder + the shared
Redis), released together by a barrier, put the same 12 entries in their own shuffled order while
reading them back in a tight loop (through the store, and straight from Redis), for 3 rounds; then
two processes race on one key through a forced interleaving: one writes it to Redis while the other
is held (by an event) between its Redis miss and its own write.

Must happen: every read is a miss or exactly the entry written (checksums pass, right key, right
KV); after each round every entry is readable from every tier in every process; Redis holds one
whole value per key; the raced key is written once (SET NX) and both processes then read it exactly.
"""

from __future__ import annotations

import multiprocessing as mp
import random

from semkv.store import DiskTier, KVStore, MemoryTier
from semkv.store.entry import decode
from semkv.store.keys import EntryKind
from semkv.store.redis_tier import RedisTier
from tests.reliability.reliability_helpers import (
    FP,
    HAMMER_ENTRIES,
    HAMMER_ROUNDS,
    hammer_entries,
    run_processes,
    same_kv,
    small_entry,
)

CTX = mp.get_context("fork")
PROCS = 4


def open_store(root, url):
    redis_tier = RedisTier(url, timeout_s=2.0)
    return KVStore([MemoryTier(4096), DiskTier(root), redis_tier], FP), redis_tier


def _hammer(root, url, barrier, results, seed: int) -> None:
    rng = random.Random(seed)
    store, redis_tier = open_store(root, url)
    reads = hits = 0
    for round_ in range(HAMMER_ROUNDS):
        entries = hammer_entries(round_)
        order = list(range(HAMMER_ENTRIES))
        rng.shuffle(order)
        barrier.wait()
        for i in order:
            assert store.put(entries[i])
            for j in rng.sample(range(HAMMER_ENTRIES), 3):
                e = entries[j]
                for got in (store.get(e.key, e.token_ids, EntryKind.CHUNK), redis_tier.get(e.key)):
                    reads += 1
                    if got is not None:
                        hits += 1
                        assert same_kv(got, e), "torn or foreign read"
        barrier.wait()
        fresh, fresh_redis = open_store(root, url)  # empty memory: reads come from disk and Redis
        for e in entries:
            for got in (fresh.get(e.key, e.token_ids, EntryKind.CHUNK), fresh_redis.get(e.key)):
                reads += 1
                assert got is not None and same_kv(got, e), "an entry reported written is missing"
                hits += 1
        fresh.close()
    assert redis_tier.stats.corrupt == 0 and redis_tier.stats.errors == 0
    results.put((reads, hits))


def test_processes_share_one_redis_and_one_folder(tmp_path, redis_server):
    root = tmp_path / "store"
    DiskTier(root)
    barrier, results = CTX.Barrier(PROCS), CTX.Queue()
    run_processes(
        [
            CTX.Process(target=_hammer, args=(root, redis_server.url, barrier, results, s))
            for s in range(PROCS)
        ]
    )
    counts = [results.get(timeout=5) for _ in range(PROCS)]
    reads, hits = sum(c[0] for c in counts), sum(c[1] for c in counts)
    print(
        f"\n[concurrency-redis] {PROCS} processes x {HAMMER_ROUNDS} rounds: {reads} reads, {hits} hits, all exact"
    )
    tier = RedisTier(redis_server.url)
    for round_ in range(HAMMER_ROUNDS):
        for e in hammer_entries(round_):
            raw = tier.client.get(tier.redis_key(e.key))
            assert same_kv(decode(raw), e)
    assert len(list(tier.keys())) == HAMMER_ROUNDS * HAMMER_ENTRIES
    assert not list(root.glob(f"*/{DiskTier.TMP_PREFIX}*")) and not (root / "quarantine").exists()


def _late_writer(root, url, entry, missed, go_on, results) -> None:
    store, redis_tier = open_store(root, url)
    assert store.get(entry.key, entry.token_ids, EntryKind.CHUNK) is None  # a miss everywhere
    missed.set()
    assert go_on.wait(30)  # meanwhile the other process computes and writes the same entry
    assert store.put(entry)
    got = open_store(root, url)[0].get(entry.key, entry.token_ids, EntryKind.CHUNK)
    results.put((redis_tier.stats.writes, got is not None and same_kv(got, entry)))


def test_two_processes_race_on_one_key(tmp_path, redis_server):
    root = tmp_path / "store"
    entry = small_entry(list(range(80)))
    missed, go_on, results = CTX.Event(), CTX.Event(), CTX.Queue()
    late = CTX.Process(target=_late_writer, args=(root, redis_server.url, entry, missed, go_on, results))
    late.start()
    assert missed.wait(60)
    store, redis_tier = open_store(root, redis_server.url)
    assert store.put(entry) and redis_tier.stats.writes == 1
    go_on.set()
    late.join(60)
    assert late.exitcode == 0
    late_writes, late_read_ok = results.get(timeout=5)
    assert late_writes == 0 and late_read_ok  # SET NX: the second writer did not overwrite
    assert same_kv(redis_tier.get(entry.key), entry)
