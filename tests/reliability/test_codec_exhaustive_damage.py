"""Every single-byte change and every truncation of a stored entry is detected by decode.

Injected: for one encoded entry (a prefix block with meta, parent and an extra tensor; ~1.4 KB),
every byte position XOR-ed with 0x01, with 0x80 and with 0xFF, every truncation length from 0 to
len-1, and every byte position deleted or duplicated; plus 2 000 seeded random multi-byte
corruptions.

Must happen: ``decode`` raises ``CorruptEntry`` every time — never another exception type, and never
an entry (a changed entry that decoded would be wrong KV or wrong ownership served silently).
"""

from __future__ import annotations

import random

import torch

from semkv.store.entry import CorruptEntry, KVEntry, decode, encode
from semkv.store.keys import EntryKind, block_key

FP = "c" * 64


def sample() -> bytes:
    g = torch.Generator().manual_seed(3)
    parent = block_key(FP, 4, None, [1, 2, 3, 4])
    entry = KVEntry(
        block_key(FP, 4, parent, [5, 6, 7, 8]),
        EntryKind.BLOCK,
        FP,
        [5, 6, 7, 8],
        torch.randn(2, 2, 4, 8, generator=g).half(),
        torch.randn(2, 2, 4, 8, generator=g).half(),
        block_size=4,
        parent=parent,
        extras={"summary": torch.randn(2, 8, generator=g)},
        meta={"prefix_sha256": "ab" * 32, "text": "caf\u00e9"},
    )
    return encode(entry)


def assert_detected(data: bytes, what: str) -> None:
    try:
        decode(data)
    except CorruptEntry:
        return
    raise AssertionError(f"{what}: damaged entry decoded without error")


def test_every_single_byte_change_and_truncation_is_detected():
    data = sample()
    assert decode(data).token_ids == [5, 6, 7, 8]
    runs = 0
    for i in range(len(data)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[i] ^= mask
            assert_detected(bytes(damaged), f"byte {i} ^ {mask:#x}")
            runs += 1
        assert_detected(data[:i], f"truncated to {i}")
        assert_detected(data[:i] + data[i + 1 :], f"byte {i} deleted")
        assert_detected(data[: i + 1] + data[i:], f"byte {i} duplicated")
        runs += 3
    print(f"\n[codec] {len(data)}-byte entry: {runs} single-byte damages and truncations, all detected")


def test_random_multi_byte_corruption_is_detected():
    data = sample()
    rng = random.Random(5)
    for run in range(2000):
        damaged = bytearray(data)
        for _ in range(rng.randint(2, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        if bytes(damaged) == data:
            continue
        assert_detected(bytes(damaged), f"random corruption {run}")
