"""Several processes share one share-index folder: none loses another's records.

Injected: 4 forked processes, released together by a barrier, each run 240 operations on one index
folder (``compact_every=16``, so the folder is compacted about 60 times while the others append):
add a prompt of its own (80%), remove one it added earlier (10%), or compact explicitly (10%); each
also queries now and then. The old index let one process's compaction replace the snapshot with its
own in-memory view and empty the journal, dropping every record the others had appended since they
opened it; and swept the others' temp files.

Must hold: a fresh index opened on the folder afterwards holds exactly every record added and not
removed, by every process (records lost = 0, records resurrected = 0); each process, after a sync,
sees the same; no temp file is left; every process exits cleanly.
"""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np

from semkv.reuse.lsh import IndexConfig, PromptIndex

CTX = mp.get_context("fork")
PROCS = 4
OPS = 240
CONFIG = IndexConfig(compact_every=16)


def prompt(proc: int, i: int) -> list[int]:
    rng = np.random.default_rng(proc * 100_000 + i)
    return rng.integers(0, 49_152, 80).tolist()


def key(proc: int, i: int) -> str:
    return f"{proc:02x}{i:062x}"


def _worker(folder, proc: int, barrier, results) -> None:
    rng = random.Random(proc)
    index = PromptIndex(CONFIG, folder, sync_interval_s=0.0)
    barrier.wait()
    live: list[int] = []
    removed: list[int] = []
    compactions = 0
    for i in range(OPS):
        roll = rng.random()
        if roll < 0.8 or not live:
            index.add(key(proc, i), prompt(proc, i))
            live.append(i)
        elif roll < 0.9:
            gone = live.pop(rng.randrange(len(live)))
            assert index.remove(key(proc, gone))
            removed.append(gone)
        else:
            index.flush()
            compactions += 1
        if i % 25 == 0:
            index.query(index.signature(prompt(proc, i)))
    barrier.wait()  # every process done writing
    index.sync()
    results.put((proc, sorted(live), sorted(removed), sorted(index.keys), compactions, index.write_errors))


def test_four_processes_lose_no_records(tmp_path):
    folder = tmp_path / "index"
    barrier = CTX.Barrier(PROCS)
    results = CTX.Queue()
    procs = [CTX.Process(target=_worker, args=(folder, p, barrier, results)) for p in range(PROCS)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * PROCS
    expected = {key(proc, i) for proc, live, _, _, _, _ in outcomes for i in live}
    removed = {key(proc, i) for proc, _, gone, _, _, _ in outcomes for i in gone}
    fresh = PromptIndex(CONFIG, folder)
    present = set(fresh.keys)
    lost, resurrected = expected - present, present & removed
    compactions = sum(o[4] for o in outcomes) + OPS * PROCS // CONFIG.compact_every
    print(
        f"\n[share index] {PROCS} processes x {OPS} operations, ~{compactions} compactions: "
        f"{len(expected)} live records, {len(lost)} lost, {len(resurrected)} resurrected"
    )
    assert not lost and not resurrected and present == expected
    for proc, _, _, seen, _, write_errors in outcomes:
        assert set(seen) == expected, f"process {proc} sees {len(set(seen) ^ expected)} records differently"
        assert write_errors == 0
    assert not list(folder.glob(".tmp-*"))
    for k in list(expected)[:20]:  # the signatures survived too, not just the keys
        proc, i = int(k[:2], 16), int(k[2:], 16)
        assert fresh.query(fresh.signature(prompt(proc, i)))[0].key == k
