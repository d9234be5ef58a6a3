"""A Redis Cluster master killed with SIGKILL mid-run (3 masters + 3 replicas, cluster-node-timeout 1 s).

Injected: (1) writer threads putting entries and a reader thread reading them back through RedisTier
while a master that has a replica is killed; the run goes on until its replica is promoted and a while
after; then the killed node is started again (it rejoins as the new master's replica). (2) Four
clients sending prompts through ``semkv route`` to two ``semkv serve`` processes that keep no KV of
their own (every reuse is read from the cluster) while another master is killed.

Must happen: (1) every entry whose write was acknowledged (WAIT: its replica held it) is read back
whole after the failover: none lost, none different; reads of the killed master's slots are misses
until the promotion, then hits again; an idle reader with a 30 s backoff whose slot map was refreshed
once before the promotion (a stale view) finds the promoted replica within 5 s; writes there are stored but not acknowledged while the new
master has no replica, and acknowledged again once the old master rejoins as its replica. (2) every
request is answered 200 with exactly the greedy answer of a no-reuse run, the backends' /metrics show
the failover (``semkv_store_tier_failovers_total``), and KV is still read from the cluster after it.
The counts are printed (run with ``-s``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from redis.crc import key_slot

from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKind, chunk_key
from semkv.store.redis_tier import RedisTier
from tests.route.serving_helpers import TINY, start_routed_pair

FP = "c" * 64


def make_entry(writer: int, index: int) -> KVEntry:
    ids = [writer, index, 11, 13]
    g = torch.Generator().manual_seed(writer * 1_000_003 + index)
    k, v = torch.randn(2, 2, 4, 8, generator=g).half(), torch.randn(2, 2, 4, 8, generator=g).half()
    return KVEntry(chunk_key(FP, ids), EntryKind.CHUNK, FP, ids, k, v)


def same(a: KVEntry | None, b: KVEntry) -> bool:
    return a is not None and a.key == b.key and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def acknowledged_on(
    pool: list[tuple[KVEntry, bool, float]], on_slots: Callable[[KVEntry], bool], limit: int = 200
) -> list[KVEntry]:
    """The first ``limit`` entries of a writer's ``pool`` whose write was acknowledged, on the given slots."""
    return [e for e, acked, _ in pool if acked and on_slots(e)][:limit]


def tier(url: str) -> RedisTier:
    return RedisTier(url, timeout_s=0.5, base_backoff_s=0.2, max_backoff_s=1.0, namespace="failover")


def test_killed_master_loses_no_acknowledged_entry(redis_cluster):
    victim = redis_cluster.master_names()[0]
    assert redis_cluster.replica_of(victim) is not None
    stop = threading.Event()
    written: list[list[tuple[KVEntry, bool, float]]] = [[], []]
    reads: list[tuple[float, bool, bool]] = []  # (time, an acknowledged entry on the victim's slots, hit)
    wrong: list[str] = []

    victim_ranges = next(n.slot_ranges for n in redis_cluster.topology() if n.name == victim)

    def victim_slot(entry: KVEntry) -> bool:
        slot = key_slot(entry.key.encode())
        return any(lo <= slot <= hi for lo, hi in victim_ranges)

    def write(w: int) -> None:
        t = tier(redis_cluster.url)
        i = 0
        while not stop.is_set():
            entry = make_entry(w, i)
            written[w].append((entry, t.put(entry), time.monotonic()))
            i += 1
        t.close()

    def read() -> None:
        t = tier(redis_cluster.url)
        i = 0
        while not stop.is_set():
            pool = written[i % 2]
            if len(pool) > 10:
                entry, acked, _ = pool[(i * 7919) % (len(pool) - 5)]
                got = t.get(entry.key)
                if got is not None and not same(got, entry):
                    wrong.append(entry.key)
                reads.append((time.monotonic(), acked and victim_slot(entry), got is not None))
            i += 1
        t.close()

    # An idle reader whose breaker, once open, would stay open for 30 s: only the slot-map refresh done
    # while a breaker is open lets it find the promoted replica.
    idle = RedisTier(
        redis_cluster.url, timeout_s=0.5, base_backoff_s=30.0, max_backoff_s=60.0, namespace="failover"
    )
    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)] + [threading.Thread(target=read)]
    for th in threads:
        th.start()
    try:
        # entries acknowledged on the victim's slots before the kill (writes start unacknowledged while
        # a loaded machine's replicas lag behind WAIT: wait for some rather than a fixed time)
        deadline = time.monotonic() + 15.0
        time.sleep(1.0)
        while not (early := acknowledged_on(written[0], victim_slot)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert early, (len(written[0]), sum(acked for _, acked, _ in written[0]))
        assert all(same(idle.get(e.key), e) for e in early)
        killed_at = time.monotonic()
        redis_cluster.kill(victim)
        assert idle.get(early[0].key) is None and idle.stats.outages == 1  # its breaker opens
        # Refused by the open breaker; refreshes the slot map before the cluster has promoted anyone
        # (that takes the 1 s node timeout), so this refresh still sees the dead master.
        assert idle.get(early[0].key) is None and idle.stats.failovers == 0
        promoted = redis_cluster.wait_promoted(victim, timeout=60)
        promoted_at = time.monotonic()
        # The stale refresh must not blind the idle reader for its 30 s backoff: a later refresh
        # (refresh_interval_s = 0.5 s) finds the promoted replica.
        while idle.stats.failovers == 0 and time.monotonic() < promoted_at + 5.0:
            idle.get(early[0].key)
            time.sleep(0.05)
        idle_found_s = time.monotonic() - promoted_at
        idle_hits = sum(same(idle.get(e.key), e) for e in early)
        time.sleep(1.5)
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert idle_hits == len(early) and idle.stats.failovers == 1, (
        idle_hits,
        len(early),
        idle_found_s,
        idle.stats,
    )
    idle.close()

    checker = tier(redis_cluster.url)
    entries = [e for pool in written for e in pool]
    acknowledged = [e for e, acked, _ in entries if acked]
    lost = [e.key for e in acknowledged if checker.get(e.key) is None]
    different = [e.key for e in acknowledged if (got := checker.get(e.key)) is not None and not same(got, e)]
    victim_hits_after = sum(1 for t, v, hit in reads if v and hit and t > promoted_at + 0.5)
    victim_reads_after = sum(1 for t, v, _ in reads if v and t > promoted_at + 0.5)
    first_hit_again = min((t for t, v, hit in reads if v and hit and t > killed_at), default=float("nan"))
    after_promotion = [acked for e, acked, t in entries if victim_slot(e) and t > promoted_at + 0.5]
    print(
        f"\n[failover] writes {len(entries)}, acknowledged {len(acknowledged)}, lost {len(lost)}, "
        f"different {len(different) + len(wrong)}; promotion of {promoted} {promoted_at - killed_at:.2f} s after "
        f"SIGKILL; first hit on the killed master's slots {first_hit_again - killed_at:.2f} s after; reads of those "
        f"slots (acknowledged entries) after promotion: {victim_hits_after}/{victim_reads_after} hits; writes there after promotion "
        f"acknowledged {sum(after_promotion)}/{len(after_promotion)}"
    )
    assert len(acknowledged) > 100 and not lost and not different and not wrong
    assert victim_reads_after > 0 and victim_hits_after == victim_reads_after
    assert after_promotion and not any(after_promotion)  # no replica behind the new master: not acknowledged

    redis_cluster.restart(victim)  # comes back as the replica of the promoted master
    redis_cluster.wait_healthy()
    assert redis_cluster.replica_of(promoted) == victim
    later = next(make_entry(9, i) for i in range(10_000) if victim_slot(make_entry(9, i)))
    deadline = time.monotonic() + 10
    while not checker.put(later):  # the replication breaker retries WAIT within max_backoff_s
        assert time.monotonic() < deadline, "writes to the promoted master were never acknowledged again"
        time.sleep(0.1)
        later = make_entry(9, later.token_ids[1] + 1)
    checker.close()


QUESTIONS = ["What happened next?", "Who was there?", "Why did it matter?", "Where was it?"]
CONTEXTS = [
    "The lighthouse keeper on the northern island logs every passing ship in a green ledger. ",
    "Marmalade was first sold in Dundee by a grocer whose ship had brought a cargo of bitter oranges. ",
    "A glacier in the southern range moved eleven metres in one summer, surprising the survey team. ",
]
PROMPTS = [c * 3 + q for c in CONTEXTS for q in QUESTIONS]


@pytest.fixture(scope="module")
def pair(redis_cluster, tiny_checkpoint_shared, tmp_path_factory):
    started = start_routed_pair(tiny_checkpoint_shared, redis_cluster.url, tmp_path_factory.mktemp("pair"))
    yield started
    started.stop()


def test_master_killed_under_serving_load(redis_cluster, pair):
    redis_cluster.wait_healthy()
    router = pair.router.url
    body = {"model": TINY, "max_tokens": 4, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        reference = {
            p: client.post(
                f"{router}/v1/completions",
                json={**body, "prompt": p, "semkv": {"reuse": "none", "store_prompt": False}},
            ).json()["choices"][0]["text"]
            for p in PROMPTS
        }
    stop = threading.Event()
    answers: list[tuple[float, int, str, str, int]] = []  # (time, status, prompt, text, reused tokens)

    def client_loop(c: int) -> None:
        with httpx.Client(timeout=60) as client:
            i = c
            while not stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                r = client.post(f"{router}/v1/completions", json={**body, "prompt": prompt})
                ok = r.status_code == 200
                text = r.json()["choices"][0]["text"] if ok else r.text
                reused = int(r.json()["semkv"]["reused_tokens"]) if ok else -1
                answers.append((time.monotonic(), r.status_code, prompt, text, reused))
                i += 1

    victim = next(m for m in redis_cluster.master_names() if redis_cluster.replica_of(m) is not None)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client_loop, c) for c in range(4)]
        try:
            deadline = time.monotonic() + 60
            while len(answers) < 2 * len(PROMPTS):
                assert time.monotonic() < deadline and not any(f.done() for f in futures), (
                    "the load did not start"
                )
                time.sleep(0.05)
            killed_at = time.monotonic()
            redis_cluster.kill(victim)
            deadline = time.monotonic() + 60
            while sum(pair.redis_metric(i, "failovers") for i in range(2)) < 1:
                assert time.monotonic() < deadline, "no backend saw the failover"
                time.sleep(0.2)
            seen_at = time.monotonic()
            hits_at_failover = sum(pair.redis_metric(i, "hits") for i in range(2))
            time.sleep(3.0)
        finally:
            stop.set()
            for f in futures:
                f.result()
    hits_after = sum(pair.redis_metric(i, "hits") for i in range(2))
    outages = sum(pair.redis_metric(i, "outages") for i in range(2))
    failovers = sum(pair.redis_metric(i, "failovers") for i in range(2))
    errors = [a for a in answers if a[1] >= 500]
    wrong = [a for a in answers if a[1] == 200 and a[3] != reference[a[2]]]
    during = [a for a in answers if killed_at <= a[0] <= seen_at]
    after = [a for a in answers if a[0] > seen_at]
    print(
        f"\n[failover under load] requests {len(answers)} ({len(during)} between SIGKILL and the failover seen "
        f"{seen_at - killed_at:.2f} s later, {len(after)} after), 5xx {len(errors)}, other non-200 "
        f"{sum(1 for a in answers if a[1] != 200) - len(errors)}, wrong answers {len(wrong)}; backends' outages "
        f"{outages:.0f}, failovers {failovers:.0f}; Redis hits after the failover {hits_after - hits_at_failover:.0f}; "
        f"mean reused tokens before / after: "
        f"{sum(a[4] for a in answers if a[0] < killed_at) / max(1, sum(a[0] < killed_at for a in answers)):.1f} / "
        f"{sum(a[4] for a in after) / max(1, len(after)):.1f}"
    )
    assert not errors and all(a[1] == 200 for a in answers)
    assert not wrong, wrong[:3]
    assert failovers >= 1 and outages >= 1 and len(after) > 0
    assert hits_after > hits_at_failover  # KV still read from the cluster after the promotion
    redis_cluster.restart(victim)
    redis_cluster.wait_healthy()
