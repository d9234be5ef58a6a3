"""Several processes writing and reading the same keys in one disk folder: no torn reads, no loss.

Injected: (1) 4 forked processes released together by a barrier put the same 12 entries (each in
its own shuffled order) while reading them back in a tight loop, for 3 rounds; (2) a writer is held
(by an event) between writing its temp file and renaming it while another process reads the key
and while a *new* process opens the folder (which sweeps temp files); (3) a reader that read a
damaged file is held before quarantining it while another reader quarantines it and a writer stores
a good entry under the same key. Interleavings are forced with barriers and events, not sleeps.

Must happen: every read is either a miss or an entry that passes its checksums and equals exactly
what was written (never a torn or foreign entry); a live writer's temp file is not swept and its
rename succeeds; a good entry written during a quarantine is never moved away; afterwards there is no
temp file, nothing quarantined that was good, and every entry whose put returned True is readable.
"""

from __future__ import annotations

import multiprocessing as mp
import random

import semkv.store.tiers as tiers_module
from semkv.store.entry import decode
from semkv.store.tiers import DiskTier
from tests.reliability.reliability_helpers import (
    HAMMER_ENTRIES,
    HAMMER_ROUNDS,
    hammer_entries,
    run_processes,
    same_kv,
    small_entry,
)

CTX = mp.get_context("fork")
PROCS = 4


def _hammer(root, barrier, results, seed: int) -> None:
    rng = random.Random(seed)
    tier = DiskTier(root)
    reads = hits = 0
    for round_ in range(HAMMER_ROUNDS):
        entries = hammer_entries(round_)
        order = list(range(HAMMER_ENTRIES))
        rng.shuffle(order)
        barrier.wait()
        for i in order:
            assert tier.put(entries[i])
            for j in rng.sample(range(HAMMER_ENTRIES), 3):  # read back racing the other writers
                got = tier.get(entries[j].key)
                reads += 1
                if got is not None:
                    hits += 1
                    assert same_kv(got, entries[j]), "torn or foreign read"
        barrier.wait()
        for e in entries:
            got = tier.get(e.key)
            reads += 1
            assert got is not None and same_kv(got, e), "an entry reported written is missing"
            hits += 1
    assert tier.stats.corrupt == 0
    results.put((reads, hits))


def test_processes_hammer_the_same_keys(tmp_path):
    root = tmp_path / "store"
    DiskTier(root)
    barrier, results = CTX.Barrier(PROCS), CTX.Queue()
    run_processes([CTX.Process(target=_hammer, args=(root, barrier, results, seed)) for seed in range(PROCS)])
    counts = [results.get(timeout=5) for _ in range(PROCS)]
    reads, hits = sum(c[0] for c in counts), sum(c[1] for c in counts)
    print(
        f"\n[concurrency-disk] {PROCS} processes x {HAMMER_ROUNDS} rounds: {reads} reads, {hits} hits, all exact"
    )
    final = DiskTier(root)
    assert not list(root.glob(f"*/{DiskTier.TMP_PREFIX}*")) and not (root / "quarantine").exists()
    for round_ in range(HAMMER_ROUNDS):
        for e in hammer_entries(round_):
            assert same_kv(final.get(e.key), e)


def _held_writer(root, entry, wrote_temp, release, done) -> None:
    real_replace = tiers_module.os.replace

    def replace(src, dst):
        wrote_temp.set()
        assert release.wait(30)
        return real_replace(src, dst)

    tiers_module.os.replace = replace  # this forked process only
    assert DiskTier(root).put(entry)
    done.set()


def _reader(root, key, expect_entry, results) -> None:
    tier = DiskTier(root)  # opening the folder sweeps stale temp files
    got = tier.get(key)
    results.put(("miss" if got is None else ("exact" if same_kv(got, expect_entry) else "WRONG"), tier.swept))


def test_reader_and_new_process_during_a_held_write(tmp_path):
    root = tmp_path / "store"
    DiskTier(root)
    entry = small_entry(list(range(40)))
    wrote_temp, release, done, results = CTX.Event(), CTX.Event(), CTX.Event(), CTX.Queue()
    writer = CTX.Process(target=_held_writer, args=(root, entry, wrote_temp, release, done))
    writer.start()
    assert wrote_temp.wait(30)
    assert len(list(root.glob(f"*/{DiskTier.TMP_PREFIX}*"))) == 1  # the write is in flight
    run_processes([CTX.Process(target=_reader, args=(root, entry.key, entry, results))])
    assert results.get(timeout=5) == ("miss", 0)  # no partial entry seen; the live temp file kept
    release.set()
    writer.join(30)
    assert writer.exitcode == 0 and done.is_set()
    run_processes([CTX.Process(target=_reader, args=(root, entry.key, entry, results))])
    assert results.get(timeout=5) == ("exact", 0)


def _slow_quarantiner(root, key, read_done, go_on, results) -> None:
    real_decode = tiers_module.decode

    def decode_then_wait(data, secret=None):
        read_done.set()
        assert go_on.wait(30)
        return real_decode(data, secret)  # raises CorruptEntry: the bytes read were damaged

    tiers_module.decode = decode_then_wait
    tier = DiskTier(root)
    results.put("miss" if tier.get(key) is None else "hit")


def test_quarantine_never_moves_a_good_entry_written_meanwhile(tmp_path):
    root = tmp_path / "store"
    tier = DiskTier(root)
    good = small_entry(list(range(50)))
    assert tier.put(good)
    path = tier.path(good.key)
    damaged = bytearray(path.read_bytes())
    damaged[-5] ^= 0xFF
    path.write_bytes(bytes(damaged))

    read_done, go_on, results = CTX.Event(), CTX.Event(), CTX.Queue()
    slow = CTX.Process(target=_slow_quarantiner, args=(root, good.key, read_done, go_on, results))
    slow.start()
    assert read_done.wait(30)  # the slow reader holds the damaged bytes
    other = DiskTier(root)
    assert other.get(good.key) is None and other.stats.corrupt == 1  # another reader quarantines it
    writer = DiskTier(root)
    assert writer.put(good)  # and a writer stores a good entry: reported written
    go_on.set()
    slow.join(30)
    assert slow.exitcode == 0 and results.get(timeout=5) == "miss"
    assert same_kv(DiskTier(root).get(good.key), good), "the good entry was quarantined by a stale reader"
    assert [decode(path.read_bytes()).key] == [good.key]
    assert len(list((root / "quarantine").iterdir())) == 1  # only the damaged file
