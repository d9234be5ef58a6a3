"""A damaged share-index snapshot or journal is recovered up to the last good record, and never fails a
request.

Injected: (1) the newest snapshot of an index that was compacted several times is truncated, zeroed or
overwritten with random bytes (``np.load`` raises ``BadZipFile``, ``EOFError``, ...); (2) the only
snapshot (the first format's ``snapshot.npz``) of an engine's index is damaged, then the engine serves
prompts of 64+ tokens under ``reuse="auto"`` (the old engine failed every such request); (3) a writer
killed mid-append leaves a torn line, and the next record is appended right after it on the same
line (what the old appender did), or after it by the new appender.

Must hold: (1) every record is recovered from the previous generation's snapshot and the journals;
(2) the engine starts, serves every request, and the records written after the damage survive a
restart; (3) the record after the torn one is recovered (the old reader lost it with the torn line),
and only the torn record is counted as damaged.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from semkv.reuse.lsh import IndexConfig, PromptIndex
from tests.reliability.reliability_helpers import engine_at

LONG = "The lighthouse keeper wrote the weather, the ships and the tides in the log every night. " * 3


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 49_152, 120).tolist() for _ in range(count)]


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "random"])
def test_damaged_newest_snapshot_falls_back_to_the_one_before(tmp_path, damage):
    config = IndexConfig(compact_every=8)
    index = PromptIndex(config, tmp_path)
    stored = prompts(30)
    for i, p in enumerate(stored):
        index.add(f"{i:064x}", p)
    snapshots = sorted(tmp_path.glob("snapshot*.npz"), key=lambda p: p.stat().st_mtime_ns)
    assert len(snapshots) == 2  # the newest generation and the one kept before it
    newest = snapshots[-1]
    data = newest.read_bytes()
    if damage == "truncated":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "zeroed":
        newest.write_bytes(data[:100] + bytes(len(data) - 200) + data[-100:])
    else:
        newest.write_bytes(np.random.default_rng(1).bytes(len(data)))
    reopened = PromptIndex(config, tmp_path)
    assert len(reopened) == 30 and reopened.damaged_records >= 1
    for i in (0, 17, 29):
        assert reopened.query(reopened.signature(stored[i]))[0].key == f"{i:064x}"


def test_engine_serves_over_a_damaged_snapshot(tmp_path, tokenizer):
    home = tmp_path / "home"
    engine = engine_at(home, tokenizer)
    engine.generate(LONG, max_new_tokens=1)
    engine.paths["share"].index.flush()
    folder = engine.share_index_folder()
    snapshot = next(folder.glob("snapshot*.npz"))
    snapshot.write_bytes(b"PK\x03\x04 not a zip at all" * 10)  # BadZipFile
    restarted = engine_at(home, tokenizer)
    for i in range(3):
        g = restarted.generate(f"{LONG} Night {i}.", max_new_tokens=1, reuse="auto")
        assert g.token_ids
    assert len(restarted.paths["share"].index) >= 3
    assert len(engine_at(home, tokenizer).paths["share"].index) >= 3  # the new records persist


def record_line(key: str, signature: np.ndarray, n: int) -> str:
    body = json.dumps({"op": "add", "key": key, "n": n, "sig": signature.tobytes().hex()}, sort_keys=True)
    return json.dumps({"crc": zlib.crc32(body.encode()), "r": body})


def test_a_torn_line_does_not_swallow_the_next_record(tmp_path):
    index = PromptIndex(IndexConfig(), tmp_path)
    a, b, c = prompts(3, seed=5)
    index.add("a" * 64, a)
    journal = tmp_path / PromptIndex.JOURNAL
    torn = record_line("b" * 64, index.signature(b), len(b))[:-30]  # a writer killed mid-append
    glued = record_line("c" * 64, index.signature(c), len(c))  # the old appender wrote right after it
    journal.write_text(journal.read_text() + torn + glued + "\n")
    reopened = PromptIndex(IndexConfig(), tmp_path)
    assert "a" * 64 in reopened and "c" * 64 in reopened and "b" * 64 not in reopened
    assert reopened.damaged_records == 1
    journal.write_text(journal.read_text() + torn)  # torn again, at the very end
    appender = PromptIndex(IndexConfig(), tmp_path)
    appender.add("d" * 64, prompts(1, seed=6)[0])  # starts on a fresh line
    final = PromptIndex(IndexConfig(), tmp_path)
    assert {"a" * 64, "c" * 64, "d" * 64} <= set(final.keys)
