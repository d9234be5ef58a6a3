"""Damaged disk entries are counted misses, recomputed, quarantined — never wrong KV.

Injected: one stored prefix-block file (block 5 of 15) is damaged in one of eleven ways — a flipped
payload byte, a flipped header byte that keeps the JSON valid (block size 4 -> 5; one fingerprint
digit), truncation to half and to zero bytes, a wrong magic, an absurd header length, a well-formed
file of an older format version, a valid entry of another key copied under this name, a payload with
a correct checksum that is not safetensors, and random garbage. Then a fresh engine (empty memory
tier, same home — like a new process) serves the same prompt by prefix reuse.

Must happen: the damaged block is a counted miss (disk ``corrupt`` +1, no hit for it), blocks 0-4
are still reused and the rest recomputed, the generation equals a cache-less run token for token
(first-token logits within 1e-5), the damaged file is moved to ``store/quarantine`` and the block is
written again whole, every other stored file is byte-for-byte untouched, and a third engine reuses
the whole prefix again. Two more faults that are not damage — a directory where the file should be,
and a read refused with EACCES — are misses with an error counted and identical output.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct

import pytest
import torch

from semkv.store import tiers
from semkv.store.entry import MAGIC, decode
from semkv.store.tiers import DiskTier
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import (
    PROMPT,
    block_keys_of,
    engine_at,
    join_entry_bytes,
    split_entry_bytes,
)

DAMAGED_BLOCK = 5
NEW_TOKENS = 4


def flip_payload_byte(data: bytes, other: bytes) -> bytes:
    out = bytearray(data)
    out[-10] ^= 0x40
    return bytes(out)


def flip_block_size_digit(data: bytes, other: bytes) -> bytes:
    assert data.count(b'"block_size": 4') == 1
    return data.replace(b'"block_size": 4', b'"block_size": 5')  # '4' ^ 0x01 == '5': still valid JSON


def flip_fingerprint_digit(data: bytes, other: bytes) -> bytes:
    header, _ = split_entry_bytes(data)
    fp = header["fingerprint"].encode()
    changed = bytes([fp[0] ^ 0x01]) + fp[1:]
    return data.replace(fp, changed, 1)


def truncate_half(data: bytes, other: bytes) -> bytes:
    return data[: len(data) // 2]


def truncate_empty(data: bytes, other: bytes) -> bytes:
    return b""


def wrong_magic(data: bytes, other: bytes) -> bytes:
    return b"XEMKV" + data[5:]


def absurd_header_length(data: bytes, other: bytes) -> bytes:
    out = bytearray(data)
    struct.pack_into("<Q", out, len(MAGIC), 2**62)
    return bytes(out)


def older_format_version(data: bytes, other: bytes) -> bytes:
    header, payload = split_entry_bytes(data)
    return join_entry_bytes(dict(header, format_version=0), payload)  # checksums correct for that file


def foreign_entry(data: bytes, other: bytes) -> bytes:
    return other


def checksummed_non_safetensors(data: bytes, other: bytes) -> bytes:
    header, payload = split_entry_bytes(data)
    return join_entry_bytes(header, struct.pack("<Q", 8) + b"{nonsense" + payload[17:])


def random_garbage(data: bytes, other: bytes) -> bytes:
    return bytes(torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(7)).tolist())


DAMAGE = [
    flip_payload_byte,
    flip_block_size_digit,
    flip_fingerprint_digit,
    truncate_half,
    truncate_empty,
    wrong_magic,
    absurd_header_length,
    older_format_version,
    foreign_entry,
    checksummed_non_safetensors,
    random_garbage,
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tokenizer):
    """(model, home with the prompt's 15 blocks on disk, cache-less reference generation)."""
    model = tiny_hf_model("llama", len(tokenizer))
    home = tmp_path_factory.mktemp("pristine")
    reference = engine_at(home / "none", tokenizer, model, disk=False).generate(
        PROMPT, max_new_tokens=NEW_TOKENS, reuse="none", store_prompt=False
    )
    writer = engine_at(home, tokenizer, model)
    writer.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    writer.close()
    keys = block_keys_of(writer)
    assert len(keys) > DAMAGED_BLOCK + 2
    assert all(DiskTier(home / "store").path(k).is_file() for k in keys)
    return model, home, reference, keys


def fresh_home(pristine, tmp_path):
    model, home, reference, keys = pristine
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    disk = DiskTier(copy / "store")
    return copy, disk, {k: disk.path(k).read_bytes() for k in keys}


def assert_same_as_reference(generation, reference):
    assert generation.token_ids == reference.token_ids
    torch.testing.assert_close(generation.first_logits, reference.first_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("damage", DAMAGE, ids=[d.__name__ for d in DAMAGE])
def test_damaged_block_is_a_counted_miss_and_quarantined(pristine, tmp_path, tokenizer, damage):
    model, _, reference, keys = pristine
    home, disk, before = fresh_home(pristine, tmp_path)
    target = disk.path(keys[DAMAGED_BLOCK])
    damaged = damage(before[keys[DAMAGED_BLOCK]], before[keys[DAMAGED_BLOCK + 1]])
    assert damaged != before[keys[DAMAGED_BLOCK]]
    target.write_bytes(damaged)

    engine = engine_at(home, tokenizer, model)
    g = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, reuse="prefix")
    assert_same_as_reference(g, reference)
    assert g.stats["reused_tokens"] == DAMAGED_BLOCK * 4  # blocks before the damage still reused
    stats = engine.store.tier("disk").stats
    assert stats.corrupt == 1 and stats.hits == DAMAGED_BLOCK
    assert engine.store.stats.hits == DAMAGED_BLOCK and engine.store.stats.misses >= 1

    quarantined = list((home / "store" / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].read_bytes() == damaged
    rewritten = decode(target.read_bytes())  # written again, whole
    assert rewritten.key == keys[DAMAGED_BLOCK]
    for key in keys:  # nothing else was touched
        if key != keys[DAMAGED_BLOCK]:
            assert disk.path(key).read_bytes() == before[key]

    again = engine_at(home, tokenizer, model).generate(PROMPT, max_new_tokens=NEW_TOKENS, reuse="prefix")
    assert again.stats["reused_tokens"] == len(keys) * 4 - (
        1 if len(keys) * 4 == g.stats["prompt_tokens"] else 0
    )
    assert_same_as_reference(again, reference)


def test_directory_in_place_of_an_entry_is_a_miss(pristine, tmp_path, tokenizer):
    model, _, reference, keys = pristine
    home, disk, before = fresh_home(pristine, tmp_path)
    target = disk.path(keys[DAMAGED_BLOCK])
    target.unlink()
    target.mkdir()
    (target / "junk").write_bytes(b"x")

    engine = engine_at(home, tokenizer, model)
    g = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, reuse="prefix")
    assert_same_as_reference(g, reference)
    assert g.stats["reused_tokens"] == DAMAGED_BLOCK * 4
    assert engine.store.tier("disk").stats.errors >= 1
    assert (target / "junk").read_bytes() == b"x"  # not ours to delete
    for key in keys:
        if key != keys[DAMAGED_BLOCK]:
            assert disk.path(key).read_bytes() == before[key]


def test_read_refused_is_a_miss_and_nothing_is_removed(pristine, tmp_path, tokenizer, monkeypatch):
    model, _, reference, keys = pristine
    home, disk, before = fresh_home(pristine, tmp_path)
    refused = disk.path(keys[DAMAGED_BLOCK])
    real_read = DiskTier.read_file

    def read_file(self, path):
        if path == refused:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(self, path)

    monkeypatch.setattr(DiskTier, "read_file", read_file)
    engine = engine_at(home, tokenizer, model)
    g = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, reuse="prefix")
    assert_same_as_reference(g, reference)
    assert g.stats["reused_tokens"] == DAMAGED_BLOCK * 4
    disk_stats = engine.store.tier("disk").stats
    assert disk_stats.errors == 1 and disk_stats.corrupt == 0
    assert refused.read_bytes() == before[keys[DAMAGED_BLOCK]]  # an unreadable file is not damaged data
    assert not (home / "store" / "quarantine").exists()


def test_unreadable_file_mode_is_a_miss(pristine, tmp_path, tokenizer, monkeypatch):
    """A file whose mode forbids reading: open() fails with EACCES. Root reads any file, so for root the
    kernel's check is applied at the disk tier's open call (a file with no read bit raises EACCES there);
    for other users the kernel refuses by itself. Either way: a miss with an error counted, identical
    output, and the file left in place untouched (it is not damaged data)."""
    model, _, reference, keys = pristine
    home, disk, before = fresh_home(pristine, tmp_path)
    unreadable = disk.path(keys[DAMAGED_BLOCK])
    unreadable.chmod(0)
    refused: list[str] = []
    if os.geteuid() == 0:
        real_open = open

        def open_as_a_user(file, mode="r", *args, **kwargs):
            if "r" in mode and os.stat(file).st_mode & 0o444 == 0:
                refused.append(str(file))
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(tiers, "open", open_as_a_user, raising=False)
    engine = engine_at(home, tokenizer, model)
    g = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, reuse="prefix")
    assert_same_as_reference(g, reference)
    assert g.stats["reused_tokens"] == DAMAGED_BLOCK * 4
    disk_stats = engine.store.tier("disk").stats
    assert disk_stats.errors == 1 and disk_stats.corrupt == 0
    assert refused == ([str(unreadable)] if os.geteuid() == 0 else [])
    unreadable.chmod(0o600)
    assert unreadable.read_bytes() == before[keys[DAMAGED_BLOCK]]
    assert not (home / "store" / "quarantine").exists()
