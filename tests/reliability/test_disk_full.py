"""A full disk (ENOSPC on write) or a quota error (on rename) never fails a request or loses data.

Injected: after the store holds one prompt, every disk write fails — ``fsync`` raises ENOSPC (the
disk is full), or the rename raises EDQUOT (quota) — while the engine serves a second prompt. Both
prompts are over the share path's ``min_tokens`` (64), so every request also remembers its prompt:
a PROMPT entry in the store and a record journaled in the share index (the old engine's journal
write was unguarded: ENOSPC from its fsync failed the request). Then the disk "frees up" and the
engine serves that prompt again.

Must happen: the requests succeed with output identical to a cache-less run; each failed write is
counted as a tier error with a warning and leaves no temp file and no partial entry; the failed
share index journal write is counted (``share_index_writes``) and retried; entries stored before
are untouched; the memory tier still serves the blocks in-process; once writes work again, the same
engine writes the missing blocks to disk and journals the prompt, and a fresh engine reuses the
blocks from disk and has the prompt in its share index.
"""

from __future__ import annotations

import errno

import pytest
import torch

import semkv.store.tiers as tiers_module
from semkv.store.entry import decode
from semkv.store.tiers import DiskTier
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import PROMPT, block_keys_of, engine_at, prompt_ids

FIRST = PROMPT * 2  # > 64 tokens: remembered by the share path too
OTHER = "A second prompt, served while the disk is full, long enough to be remembered for sharing. " * 2


def failing(kind: str):
    if kind == "enospc_on_fsync":
        return "fsync", OSError(errno.ENOSPC, "No space left on device")
    return "replace", OSError(errno.EDQUOT, "Disk quota exceeded")


@pytest.mark.parametrize("kind", ["enospc_on_fsync", "edquot_on_rename"])
def test_full_disk_is_survived_and_recovered(tmp_path, tokenizer, monkeypatch, kind):
    model = tiny_hf_model("llama", len(tokenizer))
    ref_engine = engine_at(tmp_path / "ref", tokenizer, model, disk=False)
    ref = ref_engine.generate(OTHER, max_new_tokens=2, reuse="none", store_prompt=False)
    home = tmp_path / "home"
    engine = engine_at(home, tokenizer, model)
    assert len(prompt_ids(engine, FIRST)) >= 64 and len(prompt_ids(engine, OTHER)) >= 64
    engine.generate(FIRST, max_new_tokens=2)
    share = engine.paths["share"]
    assert len(share.index) == 1
    disk = DiskTier(home / "store")
    before = {p: p.read_bytes() for p in (home / "store").glob("*/*.skv")}

    name, error = failing(kind)
    real = getattr(tiers_module.os, name)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(tiers_module.os, name, fail)
    g = engine.generate(OTHER, max_new_tokens=2)
    assert g.token_ids == ref.token_ids
    torch.testing.assert_close(g.first_logits, ref.first_logits, atol=1e-5, rtol=0)
    new_keys = [k for k in block_keys_of(engine, OTHER) if not disk.path(k).exists()]
    assert new_keys and engine.store.tier("disk").stats.errors >= len(new_keys)
    assert not list((home / "store").glob(f"*/{DiskTier.TMP_PREFIX}*"))
    assert {p: p.read_bytes() for p in (home / "store").glob("*/*.skv")} == before
    assert len(share.index) == 2  # remembered in memory
    if kind == "enospc_on_fsync":
        assert engine.failure_counts()["share_index_writes"] >= 1  # the journal's fsync failed
    again = engine.generate(OTHER, max_new_tokens=2)  # served from the memory tier meanwhile
    assert again.token_ids == ref.token_ids and again.stats["reused_tokens"] > 0

    monkeypatch.setattr(tiers_module.os, name, real)  # the disk frees up
    engine.generate(OTHER, max_new_tokens=2)
    third = "An unrelated third prompt about the rivers and mountains of the far north, told slowly. " * 2
    engine.generate(third, max_new_tokens=1, reuse="none")  # remembered: its journal write carries the retry
    assert all(decode(disk.path(k).read_bytes()).key == k for k in new_keys)
    fresh = engine_at(home, tokenizer, model)
    assert len(fresh.paths["share"].index) == 3  # no record lost to the full disk
    g = fresh.generate(OTHER, max_new_tokens=2)
    assert g.token_ids == ref.token_ids and g.stats["reused_tokens"] >= len(new_keys) * 4 - 1
    assert fresh.store.tier("disk").stats.hits > 0
