"""RedisTier on a real Redis Cluster (3 masters + 3 replicas of redis-server on loopback ports).

Each test names what is injected (a URL form, a slot resharded under a running tier, a master paused,
a cluster not running, an entry of another model) and what must hold: entries spread over the masters
with every key of an entry in one hash slot; writes acknowledged only once a replica holds them; reads
and writes follow ASK and MOVED; a master that does not answer is a miss on its slots only (bounded
time, the other masters unaffected), and its slots serve again when it is back; a hit is still checked
against the stored fingerprint and token ids.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest
import redis
import torch
from redis.crc import key_slot

from semkv.config import StoreConfig
from semkv.server.process import free_port
from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKind, chunk_key
from semkv.store.redis_process import PortTaken, RedisNodeProcess
from semkv.store.redis_tier import RedisTier, redact, seed_nodes
from semkv.store.store import KVStore
from semkv.store.tiers import MemoryTier

FP_A = "a" * 64
FP_B = "b" * 64


def make_entry(seed: int, fingerprint: str = FP_A, token_ids: list[int] | None = None) -> KVEntry:
    g = torch.Generator().manual_seed(seed)
    ids = token_ids if token_ids is not None else [int(t) for t in torch.randint(0, 1000, (5,), generator=g)]
    k = torch.randn(2, 2, len(ids), 8, generator=g).half()
    v = torch.randn(2, 2, len(ids), 8, generator=g).half()
    return KVEntry(chunk_key(fingerprint, ids), EntryKind.CHUNK, fingerprint, ids, k, v)


def same(a: KVEntry | None, b: KVEntry) -> bool:
    return a is not None and a.key == b.key and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def node_client(name: str) -> redis.Redis:
    host, port = name.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port), socket_timeout=2)


def node_id(name: str) -> str:
    c = node_client(name)
    try:
        raw = c.execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    finally:
        c.close()


def holds(client: redis.Redis, name: str) -> bool:
    """Whether this node holds the key ``name`` (ASKING first: an importing node would redirect; a
    migrating node redirects a key it no longer holds)."""
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("ASKING")
    pipe.exists(name)
    try:
        return bool(pipe.execute()[1])
    except redis.exceptions.AskError:
        return False


def entry_in_slot(tier: RedisTier, slot: int, start: int) -> KVEntry:
    """An entry whose Redis key hashes to ``slot`` (token ids searched from ``start``)."""
    for i in range(start, start + 200_000):
        ids = [i, 7, 7]
        if key_slot(tier.redis_key(chunk_key(FP_A, ids)).encode()) == slot:
            return make_entry(i, token_ids=ids)
    raise AssertionError(f"no entry found for slot {slot}")


def test_url_forms(redis_cluster):
    """Seed list, one master's URL and one replica's URL all reach the cluster; they share entries."""
    masters = redis_cluster.master_names()
    seeds = RedisTier(redis_cluster.url)
    one_master = RedisTier(f"redis://{masters[1]}/0")
    one_replica = RedisTier(f"redis://{redis_cluster.replica_of(masters[2])}/0")
    try:
        assert seeds.cluster and one_master.cluster and one_replica.cluster
        assert seeds.wait_target == 1 and seeds.health == "up"
        entries = [make_entry(seed) for seed in range(100, 112)]
        assert all(seeds.put(e) for e in entries)
        assert all(same(one_master.get(e.key), e) and same(one_replica.get(e.key), e) for e in entries)
    finally:
        for tier in (seeds, one_master, one_replica):
            tier.close()
    assert seed_nodes("redis://:pw@h1:7000,h2:7001/0") == [("h1", 7000), ("h2", 7001)]
    assert seed_nodes("redis://[::1]:7000/0") == [("::1", 7000)]
    assert redact("redis://user:secret@h1:7000,h2:7001/0") == "redis://user:***@h1:7000,h2:7001/0"
    with pytest.raises(ValueError, match="bad node"):
        RedisTier("redis://h1:7000,h2:notaport/0")
    with pytest.raises(ValueError, match="Redis URL"):
        RedisTier("http://h1:7000,h2:7001")


def test_entries_spread_over_masters_acknowledged_by_replicas(redis_cluster):
    """48 entries land on all 3 masters, each key in its content key's slot; every put waited for the
    master's replica, which holds the same bytes; keys() and nbytes() cover every master."""
    tier = RedisTier(redis_cluster.url, namespace="spread")
    entries = [make_entry(seed) for seed in range(48)]
    try:
        assert all(tier.put(e) for e in entries)
        assert tier.stats.writes == 48 and tier.stats.unreplicated == 0
        per_master: dict[str, int] = {}
        for e in entries:
            name = tier.redis_key(e.key)
            assert key_slot(name.encode()) == key_slot(e.key.encode())  # the hash tag is the content key
            assert key_slot(tier.record_key("doc", e.key).encode()) == key_slot(name.encode())
            master = redis_cluster.master_of_slot(key_slot(name.encode()))
            per_master[master] = per_master.get(master, 0) + 1
            replica = node_client(redis_cluster.replica_of(master))
            try:
                replica.execute_command("READONLY")
                assert replica.get(name) == node_client(master).get(name)  # WAIT: the replica has it
            finally:
                replica.close()
        assert len(per_master) == 3 and all(n >= 5 for n in per_master.values()), per_master
        assert sorted(tier.keys()) == sorted(e.key for e in entries)
        assert tier.nbytes() == tier.stats.bytes_written
        other = RedisTier(redis_cluster.url, namespace="spread2")
        other.put(entries[0])
        assert tier.put_record("doc", "doc-1", "{}") and tier.clear() == len(entries) + 1
        assert list(tier.keys()) == [] and tier.get_record("doc", "doc-1") is None
        assert list(other.keys()) == [entries[0].key]  # another namespace is left alone
        other.close()
    finally:
        tier.close()


def test_hit_still_checks_fingerprint_and_tokens(redis_cluster):
    """Injected: model A's entry copied under the key model B looks up. B's store: a counted mismatch."""
    tier_a, tier_b = RedisTier(redis_cluster.url), RedisTier(redis_cluster.url)
    store_b = KVStore([MemoryTier(10**7), tier_b], FP_B)
    entry_a = make_entry(1)
    key_b = chunk_key(FP_B, entry_a.token_ids)
    tier_a.put(KVEntry(key_b, EntryKind.CHUNK, FP_A, entry_a.token_ids, entry_a.k, entry_a.v))
    assert store_b.get(key_b, entry_a.token_ids, EntryKind.CHUNK) is None
    assert store_b.stats.mismatches == 1 and tier_b.stats.hits == 1
    tier_a.close()
    tier_b.close()


def test_reads_and_writes_follow_ask_and_moved(redis_cluster):
    """Injected: the slot of a stored entry is resharded from master A to master B while a tier with the
    old slot map runs: the key is migrated (A answers ASK), then the slot is given to B (A answers MOVED).
    Every read is a hit with the same KV, every write lands on B and is read back."""
    tier = RedisTier(redis_cluster.url, namespace="reshard")
    a_name, b_name = redis_cluster.master_names()[:2]
    a_id, b_id = node_id(a_name), node_id(b_name)
    a, b = node_client(a_name), node_client(b_name)
    slot = next(n.slot_ranges[0][0] for n in redis_cluster.topology() if n.name == a_name)
    try:
        first = entry_in_slot(tier, slot, 0)
        assert tier.put(first) and same(tier.get(first.key), first)  # the tier's slot map: slot -> A
        b.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", a_id)
        a.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", b_id)
        host, port = b_name.rsplit(":", 1)
        a.execute_command("MIGRATE", host, int(port), tier.redis_key(first.key), 0, 5000)
        assert not holds(a, tier.redis_key(first.key)) and holds(b, tier.redis_key(first.key))

        assert same(tier.get(first.key), first)  # A: ASK -> B
        second = entry_in_slot(tier, slot, 10**6)
        tier.put(second)  # A: ASK (a new key of a migrating slot) -> written on B
        assert holds(b, tier.redis_key(second.key)) and same(tier.get(second.key), second)

        for name in redis_cluster.master_names():  # the slot now belongs to B (replicas learn it)
            c = node_client(name)
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", b_id)
            c.close()
        assert same(tier.get(first.key), first)  # A: MOVED -> B
        third = entry_in_slot(tier, slot, 2 * 10**6)
        assert tier.put(third)  # after MOVED, WAIT on B's connection acknowledges it
        assert holds(b, tier.redis_key(third.key)) and same(tier.get(third.key), third)
        assert tier.stats.errors == 0 and tier.available
    finally:
        a.close()
        b.close()
        tier.close()
    redis_cluster.wait_healthy()


def test_paused_master_is_a_miss_on_its_slots_only(redis_cluster, caplog):
    """Injected: one master paused (SIGSTOP, shorter than the cluster's failover delay). Its entries
    are misses after one bounded timeout, the other masters' entries are hits without delay, the tier
    reports "degraded"; after SIGCONT its slots are hits again."""
    tier = RedisTier(
        redis_cluster.url, timeout_s=0.2, base_backoff_s=0.2, max_backoff_s=0.4, namespace="pause"
    )
    entries = [make_entry(seed) for seed in range(200, 236)]
    assert all(tier.put(e) for e in entries)
    victim = redis_cluster.master_names()[0]
    on_victim = {e.key for e in entries if redis_cluster.master_of_slot(key_slot(e.key.encode())) == victim}
    assert 0 < len(on_victim) < len(entries)
    process = redis_cluster.node(victim)
    with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
        process.pause()
        try:
            start = time.perf_counter()
            got = {e.key: tier.get(e.key) for e in entries}
            elapsed = time.perf_counter() - start
            health = tier.health
        finally:
            process.resume()
    assert all(got[e.key] is None for e in entries if e.key in on_victim)
    assert all(same(got[e.key], e) for e in entries if e.key not in on_victim)
    assert elapsed < 0.2 + 0.6, f"36 reads with one master paused took {elapsed:.2f} s"
    assert health == "degraded" and tier.stats.outages == 1
    assert any(victim in r.message and "unavailable" in r.message for r in caplog.records)
    deadline = time.monotonic() + 10
    while not all(same(tier.get(e.key), e) for e in entries):
        assert time.monotonic() < deadline, "the paused master's slots never served again"
        time.sleep(0.1)
    assert tier.health == "up"
    tier.close()
    redis_cluster.wait_healthy()


@pytest.mark.parametrize("write_behind", [False, True])
def test_cluster_unreachable_at_start(tmp_path, caplog, write_behind):
    """Injected: a seed list where nothing listens. The store serves from its local tiers, one warning.
    Written through, every put reaches the Redis tier and is skipped there; written behind, the puts of
    an entry still queued are one write."""
    url = f"redis://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/0"
    config = StoreConfig(redis_url=url, memory_bytes=10**7, write_behind=write_behind)
    with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
        store = KVStore.from_config(config, tmp_path, FP_A)
    tier = store.tier("redis")
    assert tier.cluster and not tier.available and tier.health == "down" and tier.stats.outages == 1
    entry = make_entry(5)
    start = time.perf_counter()
    for _ in range(100):
        store.put(entry)
        assert store.get(entry.key, entry.token_ids, EntryKind.CHUNK) is not None
    assert time.perf_counter() - start < 1.0
    assert store.flush(5)
    assert tier.stats.errors == 1 and tier.stats.unavailable >= (1 if write_behind else 100)
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    store.close()


def test_write_not_acknowledged_while_the_replica_is_paused(redis_cluster, caplog):
    """Injected: one master's replica paused (SIGSTOP). A write to that master is stored but not
    acknowledged after one WAIT timeout; the next writes there skip WAIT (no timeout each) and are not
    acknowledged either; writes to the other masters are acknowledged; after SIGCONT, acknowledged again."""
    tier = RedisTier(redis_cluster.url, timeout_s=0.3, base_backoff_s=0.3, max_backoff_s=0.6, namespace="lag")
    master = redis_cluster.master_names()[0]
    replica = redis_cluster.node(redis_cluster.replica_of(master))
    mine = [
        e
        for e in (make_entry(seed) for seed in range(300, 400))
        if redis_cluster.master_of_slot(key_slot(e.key.encode())) == master
    ]
    others = [
        e
        for e in (make_entry(seed) for seed in range(400, 420))
        if redis_cluster.master_of_slot(key_slot(e.key.encode())) != master
    ]
    assert len(mine) >= 12 and others
    with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
        replica.pause()
        try:
            start = time.perf_counter()
            first = tier.put(mine[0])
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            rest = [tier.put(e) for e in mine[1:6]]
            rest_s = time.perf_counter() - start
            elsewhere = [tier.put(e) for e in others]
        finally:
            replica.resume()
    assert not first and tier.wait_timeout_s * 0.8 <= first_s < tier.timeout_s + 0.2, first_s
    assert not any(rest) and rest_s < tier.wait_timeout_s, rest_s  # WAIT skipped while its breaker is open
    assert all(elsewhere)
    assert all(same(tier.get(e.key), e) for e in mine[:6])  # stored all the same
    assert tier.stats.unreplicated == 6 and tier.stats.errors == 0 and tier.health == "up"
    assert any(master in r.message and "not acknowledged" in r.message for r in caplog.records)
    deadline = time.monotonic() + 10
    remaining = iter(mine[6:])
    while not tier.put(next(remaining)):
        assert time.monotonic() < deadline, "writes were never acknowledged again"
        time.sleep(0.1)
    tier.close()
    redis_cluster.wait_healthy()


def test_node_on_a_taken_port_fails_fast(tmp_path):
    """Injected: another process listens on the port picked for a redis-server. Its start fails at once
    (PortTaken, so the cluster launcher picks other ports), not after the start timeout."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(4)
        node = RedisNodeProcess(tmp_path, taken.getsockname()[1])
        start = time.perf_counter()
        with pytest.raises(PortTaken):
            node.start(timeout=10)
        assert time.perf_counter() - start < 5 and not node.running
