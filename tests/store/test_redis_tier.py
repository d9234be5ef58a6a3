"""RedisTier against a real redis-server: round trip, sharing, and every way Redis fails.

Each test names what is injected (Redis absent, killed, hanging, a damaged value, an
entry of another model) and what must happen (a miss and a warning, bounded time,
local tiers still serving, recovery when Redis is back).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import redis
import torch

from semkv.config import StoreConfig
from semkv.server.process import free_port
from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKind, chunk_key
from semkv.store.redis_tier import CircuitBreaker, RedisTier, redact
from semkv.store.store import KVStore
from semkv.store.tiers import MemoryTier

FP_A = "a" * 64
FP_B = "b" * 64


def make_entry(fingerprint: str = FP_A, tokens: int = 5, seed: int = 0) -> KVEntry:
    g = torch.Generator().manual_seed(seed)
    token_ids = [int(t) for t in torch.randint(0, 1000, (tokens,), generator=g)]
    k = torch.randn(2, 2, tokens, 8, generator=g).half()
    v = torch.randn(2, 2, tokens, 8, generator=g).half()
    return KVEntry(chunk_key(fingerprint, token_ids), EntryKind.CHUNK, fingerprint, token_ids, k, v)


def test_round_trip_and_listing(redis_server):
    """Put then get in another tier object (another process's view): same tensors, counted in stats."""
    writer = RedisTier(redis_server.url)
    reader = RedisTier(redis_server.url)
    entry = make_entry()
    assert writer.put(entry) and writer.put(entry)  # second put is a no-op (SET NX)
    assert writer.stats.writes == 1
    got = reader.get(entry.key)
    assert got is not None and got.token_ids == entry.token_ids
    assert torch.equal(got.k, entry.k) and torch.equal(got.v, entry.v)
    assert entry.key in reader and "0" * 64 not in reader
    assert list(reader.keys()) == [entry.key]
    assert reader.nbytes() == reader.stats.bytes_read > entry.nbytes
    assert reader.stats.hits == 1 and reader.get(make_entry(seed=1).key) is None and reader.stats.misses == 1
    reader.delete(entry.key)
    assert entry.key not in writer
    writer.close()
    reader.close()


def test_namespaces_are_separate(redis_server):
    """Two namespaces on one database never see each other's entries."""
    one, two = RedisTier(redis_server.url, namespace="one"), RedisTier(redis_server.url, namespace="two")
    entry = make_entry()
    one.put(entry)
    assert entry.key in one and entry.key not in two and list(two.keys()) == []


def test_store_reads_through_from_redis(redis_server, tmp_path):
    """KVStore.from_config with redis_url: a second store (fresh memory + disk) is served from Redis,
    and the hit is promoted into its faster tiers."""
    config = StoreConfig(redis_url=redis_server.url, memory_bytes=10**7)
    first = KVStore.from_config(config, tmp_path / "a", FP_A)
    second = KVStore.from_config(config, tmp_path / "b", FP_A)
    assert [t.name for t in second.tiers] == ["memory", "disk", "redis"]
    entry = make_entry()
    first.put(entry)
    got = second.get(entry.key, entry.token_ids, EntryKind.CHUNK)
    assert got is not None and torch.equal(got.k, entry.k)
    assert second.tier("redis").stats.hits == 1
    assert entry.key in second.tier("memory") and entry.key in second.tier("disk")


def test_entry_of_another_model_is_never_served(redis_server):
    """Injected: model A's entry copied under the key model B would look up. B's store treats it as a miss."""
    tier_a, tier_b = RedisTier(redis_server.url), RedisTier(redis_server.url)
    store_b = KVStore([MemoryTier(10**7), tier_b], FP_B)
    entry_a = make_entry(FP_A)
    key_b = chunk_key(FP_B, entry_a.token_ids)
    assert key_b != entry_a.key  # keys already differ by fingerprint
    tier_a.put(entry_a)
    forged = KVEntry(key_b, EntryKind.CHUNK, FP_A, entry_a.token_ids, entry_a.k, entry_a.v)
    tier_a.put(forged)
    assert store_b.get(key_b, entry_a.token_ids, EntryKind.CHUNK) is None
    assert store_b.stats.mismatches == 1 and key_b not in store_b.tier("memory")


def test_damaged_value_is_a_miss_and_removed(redis_server, caplog):
    """Injected: a truncated value and a value under a foreign key. Both: a miss, counted, deleted."""
    tier = RedisTier(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    good, other = make_entry(seed=0), make_entry(seed=1)
    tier.put(good)
    client.set(tier.redis_key(good.key), client.get(tier.redis_key(good.key))[:-10])
    tier.put(other)
    client.copy(tier.redis_key(other.key), tier.redis_key("f" * 64))
    with caplog.at_level(logging.WARNING):
        assert tier.get(good.key) is None
        assert tier.get("f" * 64) is None
    assert tier.stats.corrupt == 2 and tier.stats.misses == 2
    assert not client.exists(tier.redis_key(good.key)) and not client.exists(tier.redis_key("f" * 64))
    assert tier.get(other.key) is not None and tier.available


def test_redis_down_at_start(tmp_path, caplog):
    """Injected: nothing listens on the Redis port. The store still serves from the local tiers,
    one warning is logged, and calls cost nothing while the circuit is open."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
        store = KVStore.from_config(StoreConfig(redis_url=url, memory_bytes=10**7), tmp_path, FP_A)
    redis_tier = store.tier("redis")
    assert not redis_tier.available and redis_tier.stats.outages == 1
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    entry = make_entry()
    start = time.perf_counter()
    for _ in range(200):
        store.put(entry)
        assert store.get(entry.key, entry.token_ids, EntryKind.CHUNK) is not None
    assert time.perf_counter() - start < 2.0
    assert redis_tier.stats.unavailable >= 200 and redis_tier.stats.errors == 1
    assert store.summary()["tiers"]["redis"]["bytes"] == 0


def test_redis_killed_mid_run_then_back(redis_server, tmp_path, caplog):
    """Injected: redis-server killed after a write, then restarted on the same port (empty).
    During the outage: misses, local tiers serve, one warning; afterwards the tier writes and reads again."""
    tier = RedisTier(redis_server.url, base_backoff_s=0.2, max_backoff_s=0.2)
    store = KVStore([MemoryTier(10**7), tier], FP_A)
    entry = make_entry()
    store.put(entry)
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
        assert tier.get(entry.key) is None  # the failing call
        start = time.perf_counter()
        for _ in range(100):
            assert tier.get(entry.key) is None
            assert store.get(entry.key, entry.token_ids, EntryKind.CHUNK) is not None  # memory still serves
        assert time.perf_counter() - start < 1.0
        assert tier.stats.errors >= 1 and tier.stats.outages == 1 and tier.stats.unavailable > 0
        redis_server.start()
        time.sleep(0.25)
        other = make_entry(seed=3)
        deadline = time.monotonic() + 5
        while not tier.put(other) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert tier.available and tier.get(other.key) is not None
    assert sum("reachable again" in r.message for r in caplog.records) == 1
    assert sum("is unavailable" in r.message for r in caplog.records) == 1


def test_hanging_redis_costs_bounded_time():
    """Injected: a TCP server that accepts and never answers. Each call is bounded by the socket
    timeout, and the circuit breaker keeps 50 lookups from costing 50 timeouts."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        start = time.perf_counter()
        tier = RedisTier(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.2)
        for seed in range(50):
            assert tier.get(make_entry(seed=seed).key) is None
        elapsed = time.perf_counter() - start
        assert elapsed < 1.5, f"50 lookups against a hanging Redis took {elapsed:.2f} s"
        assert tier.stats.errors == 1 and tier.stats.unavailable == 50
    finally:
        stop.set()
        thread.join()
        for s in accepted:
            s.close()
        listener.close()


def test_circuit_breaker_backoff_doubles_and_half_opens():
    now = [0.0]
    breaker = CircuitBreaker(1.0, 4.0, clock=lambda: now[0])
    assert breaker.allow() and breaker.failure()
    assert not breaker.allow()
    now[0] = 1.0
    assert breaker.allow() and not breaker.allow()  # one trial call in the half-open state
    assert not breaker.failure()  # still the same outage; backoff now 2 s
    now[0] = 2.9
    assert not breaker.allow()
    now[0] = 3.0
    assert breaker.allow()
    breaker.failure()  # backoff 4 s (the cap)
    breaker.failure()
    now[0] = 3.0 + 3.9
    assert not breaker.allow()
    now[0] = 3.0 + 4.0
    assert breaker.allow()
    breaker.success()
    assert breaker.closed and breaker.allow() and breaker.allow()


def test_invalid_settings_fail_early():
    with pytest.raises(ValueError, match="Redis URL"):
        RedisTier("http://localhost:6379")
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        RedisTier("redis://localhost:1/0", timeout_s=0)
    assert redact("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
