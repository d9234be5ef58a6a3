"""Write-behind of the tiers below memory (semkv/store/writer.py), on a real disk tier.

Injected: a disk tier whose writes wait on a gate (so a write can be held "in flight"), a tier that
raises on every write, a queue bound smaller than two entries, and a process that exits without closing
its store. What must happen: a put returns before the disk write, every read in between serves the
entry, nothing queued is lost (flush, close, interpreter exit), a deleted entry is never written after
its delete, a failing tier is counted and never fails the caller, and a full queue makes the put wait.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from semkv.config import StoreConfig
from semkv.store import DiskTier, EntryKind, KVEntry, KVStore, MemoryTier, chunk_key

FP = "f" * 64


def entry(tokens: list[int]) -> KVEntry:
    """2 layers, 1 KV head, d=4, fp16: 32 bytes per token."""
    g = torch.Generator().manual_seed(sum(tokens) + len(tokens))
    k = torch.randn(2, 1, len(tokens), 4, generator=g).half()
    v = torch.randn(2, 1, len(tokens), 4, generator=g).half()
    return KVEntry(chunk_key(FP, tokens), EntryKind.CHUNK, FP, tokens, k, v)


class GatedDisk(DiskTier):
    """A disk tier whose writes wait until ``gate`` is set; ``started`` is set when a write begins."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.started = threading.Event()

    def put(self, entry: KVEntry) -> bool:
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().put(entry)


class FailingDisk(DiskTier):
    def put(self, entry: KVEntry) -> bool:
        raise OSError("disk full (injected)")


def gated_store(tmp_path: Path, max_pending_bytes: int = 10**6) -> tuple[KVStore, GatedDisk]:
    disk = GatedDisk(tmp_path / "disk")
    return KVStore([MemoryTier(10**6), disk], FP, write_behind_bytes=max_pending_bytes), disk


def test_a_put_returns_before_the_disk_write_and_reads_serve_the_entry_meanwhile(tmp_path):
    store, disk = gated_store(tmp_path)
    e = entry([1, 2, 3])
    assert store.put(e)  # returns although the disk write is held
    assert disk.started.wait(5) and not disk.path(e.key).exists()
    store.tiers[0].delete(e.key)  # evicted from memory before its disk write is done
    assert store.contains(e.key) and store.held_by_all(e.key)
    got = store.get(e.key, [1, 2, 3], EntryKind.CHUNK)
    assert got is not None and torch.equal(got.k, e.k)
    assert e.key in store.tiers[0]  # promoted back into memory
    assert store.get(e.key, [1, 2, 4]) is None  # ownership is still checked on a queued entry
    disk.gate.set()
    assert store.flush(5)
    assert disk.path(e.key).is_file() and store.writer is not None and store.writer.pending(e.key) is None
    assert store.summary()["write_behind"]["written"] == 1
    store.close()


def test_close_writes_what_is_queued(tmp_path):
    store, disk = gated_store(tmp_path)
    entries = [entry([i, i + 1]) for i in range(5)]
    for e in entries:
        store.put(e)
    threading.Timer(0.2, disk.gate.set).start()
    store.close()
    reopened = KVStore([MemoryTier(10**6), DiskTier(tmp_path / "disk")], FP)
    assert all(reopened.get(e.key, e.token_ids) is not None for e in entries)


def test_a_deleted_entry_is_not_written_after_its_delete(tmp_path):
    store, disk = gated_store(tmp_path)
    first, second = entry([1, 2]), entry([3, 4])
    store.put(first)  # taken by the thread, held in flight
    assert disk.started.wait(5)
    store.put(second)  # queued behind it
    store.delete(second.key)  # cancelled before its turn
    threading.Timer(0.2, disk.gate.set).start()
    store.delete(first.key)  # in flight: waits for the write, then deletes it
    assert store.flush(5)
    assert not disk.path(first.key).exists() and not disk.path(second.key).exists()
    assert store.get(first.key) is None and store.get(second.key) is None
    assert store.writer is not None and store.writer.stats.cancelled == 1
    store.close()


def test_a_full_queue_makes_the_put_wait_for_room(tmp_path):
    one = entry([1, 2, 3]).nbytes
    store, disk = gated_store(tmp_path, max_pending_bytes=one + one // 2)
    store.put(entry([1, 2, 3]))
    assert disk.started.wait(5)
    done = threading.Event()
    threading.Thread(target=lambda: (store.put(entry([4, 5, 6])), done.set()), daemon=True).start()
    assert not done.wait(0.3), "the second put should wait while the first fills the queue"
    disk.gate.set()
    assert done.wait(5)
    assert store.flush(5) and store.writer is not None and store.writer.stats.stalls == 1
    assert all(disk.path(entry(t).key).is_file() for t in ([1, 2, 3], [4, 5, 6]))
    store.close()


def test_a_failing_tier_is_counted_and_never_fails_the_put(tmp_path):
    disk = FailingDisk(tmp_path / "disk")
    store = KVStore([MemoryTier(10**6), disk], FP, write_behind_bytes=10**6)
    e = entry([9, 9])
    assert store.put(e)
    assert store.flush(5)
    assert store.stats.tier_errors == 1 and disk.stats.errors == 1
    assert store.get(e.key, [9, 9]) is not None  # memory still holds it
    store.close()


def test_without_write_behind_the_disk_holds_the_entry_when_put_returns(tmp_path):
    disk = DiskTier(tmp_path / "disk")
    store = KVStore([MemoryTier(10**6), disk], FP)
    e = entry([5, 6])
    store.put(e)
    assert store.writer is None and disk.path(e.key).is_file()


def test_from_config_writes_behind_only_when_told_to(tmp_path):
    on = KVStore.from_config(StoreConfig(secret=None, write_behind=True), tmp_path / "a", FP)
    off = KVStore.from_config(StoreConfig(secret=None), tmp_path / "b", FP)
    memory_only = KVStore.from_config(
        StoreConfig(secret=None, disk=False, write_behind=True), tmp_path / "c", FP
    )
    assert on.writer is not None and on.writer.max_pending_bytes == StoreConfig().write_behind_bytes
    assert off.writer is None and memory_only.writer is None
    for store in (on, off, memory_only):
        store.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_write_behind_bytes_is_validated(bad):
    with pytest.raises(ValueError, match="write_behind_bytes"):
        StoreConfig(write_behind_bytes=bad)


def test_write_behind_must_be_a_bool():
    with pytest.raises(ValueError, match="write_behind must be a bool"):
        StoreConfig(write_behind="yes")  # type: ignore[arg-type]


def test_a_process_that_exits_without_closing_its_store_still_writes_its_entries(tmp_path):
    """A real child process puts entries through a store built from the config and exits without
    closing it; the entries must be on disk afterwards (the writer flushes at interpreter exit)."""
    script = textwrap.dedent(
        f"""
        import torch
        from pathlib import Path
        from semkv.config import StoreConfig
        from semkv.store import EntryKind, KVEntry, KVStore, chunk_key
        store = KVStore.from_config(StoreConfig(secret=None, write_behind=True), Path({str(tmp_path)!r}), {FP!r})
        for i in range(20):
            tokens = [i, i + 1]
            k = torch.zeros(2, 1, 2, 4, dtype=torch.float16)
            store.put(KVEntry(chunk_key({FP!r}, tokens), EntryKind.CHUNK, {FP!r}, tokens, k, k.clone()))
        """
    )
    env = {**os.environ, "SEMKV_STORE_SECRET": ""}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    disk = DiskTier(tmp_path / "store")
    assert sum(1 for _ in disk.keys()) == 20
    assert all(chunk_key(FP, [i, i + 1]) in disk for i in range(20))


def test_flush_times_out_while_a_write_is_held(tmp_path):
    store, disk = gated_store(tmp_path)
    store.put(entry([1, 1]))
    start = time.monotonic()
    assert not store.flush(0.2)
    assert 0.15 < time.monotonic() - start < 5
    disk.gate.set()
    assert store.flush(5)
    store.close()
