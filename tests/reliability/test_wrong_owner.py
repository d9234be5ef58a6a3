"""An entry written under another model, tokenizer, KV dtype or block size is never reused.

Injected: engine A (tiny Llama, seed 0, fp32 KV, block size 4) fills a disk store; then engines that
differ in exactly one thing read the same home folder: other weights (seed 1), another family
(Qwen2), another tokenizer (one added token: same ids for this prompt), fp16 and bf16 KV, block
sizes 8 and 2. To prove the *checks* and not only the key separation stop reuse, the block key
function is forced to depend on the block index alone, so every owner's block i lands on A's file.

Must happen: no variant reuses a single token (no store hit), each counts mismatches, each generation
equals its own cache-less run, and A's entries are all still there and intact afterwards. Without
the forced collision the variants' keys differ from A's (checked too).
"""

from __future__ import annotations

import copy

import pytest
import torch

import semkv.store.keys as keys_module
from semkv.store.entry import decode
from semkv.store.tiers import DiskTier
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import PROMPT, block_keys_of, engine_at


def index_only_block_key(fingerprint, block_size, parent, token_ids, namespace=None):
    return keys_module.hash_fields("index-only", parent)


@pytest.fixture(scope="module")
def owner(tokenizer, tmp_path_factory):
    """(A's model, home written by A under index-only keys, A's block keys)."""
    model = tiny_hf_model("llama", len(tokenizer), seed=0)
    home = tmp_path_factory.mktemp("owner")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(keys_module, "block_key", index_only_block_key)
        a = engine_at(home, tokenizer, model)
        a.generate(PROMPT, max_new_tokens=2)
        again = a.generate(PROMPT, max_new_tokens=2)
        assert again.stats["reused_tokens"] > 0  # A itself does reuse its entries
        keys = block_keys_of(a)
    return model, home, keys


def variant(name: str, tokenizer, model):
    """(engine kwargs, tokenizer) of a variant that differs from A in one thing."""
    if name == "other_weights":
        return {"hf_model": tiny_hf_model("llama", len(tokenizer), seed=1)}, tokenizer
    if name == "other_family":
        return {"hf_model": tiny_hf_model("qwen2", len(tokenizer)), "family": "qwen2"}, tokenizer
    if name == "other_tokenizer":
        other = copy.deepcopy(tokenizer)
        other.add_tokens(["<semkv-extra-token>"])
        return {"hf_model": model}, other
    if name in ("float16", "bfloat16"):
        return {"hf_model": model, "kv_dtype": name}, tokenizer
    if name.startswith("block_size_"):
        return {"hf_model": model, "block_size": int(name.rsplit("_", 1)[1])}, tokenizer
    raise AssertionError(name)


VARIANTS = [
    "other_weights",
    "other_family",
    "other_tokenizer",
    "float16",
    "bfloat16",
    "block_size_8",
    "block_size_2",
]


@pytest.mark.parametrize("name", VARIANTS)
def test_foreign_entries_are_never_reused(owner, tmp_path, tokenizer, monkeypatch, name):
    model, home, a_keys = owner
    kwargs, tok = variant(name, tokenizer, model)
    ref_engine = engine_at(tmp_path / "ref", tok, disk=False, **kwargs)
    ref = ref_engine.generate(PROMPT, max_new_tokens=2, reuse="none", store_prompt=False)
    assert block_keys_of(ref_engine) != a_keys  # with the real key function, no key is shared at all
    disk_before = {k: DiskTier(home / "store").path(k).read_bytes() for k in a_keys}

    monkeypatch.setattr(keys_module, "block_key", index_only_block_key)
    engine = engine_at(home, tok, **kwargs)
    assert engine.fingerprint != engine_at(tmp_path / "a", tokenizer, model).fingerprint or name.startswith(
        "block"
    )
    g = engine.generate(PROMPT, max_new_tokens=2, reuse="prefix")  # the prefix blocks are what is tested
    assert g.stats["reused_tokens"] == 0
    assert engine.store.stats.hits == 0 and engine.store.stats.mismatches > 0
    assert g.token_ids == ref.token_ids
    torch.testing.assert_close(g.first_logits, ref.first_logits, atol=1e-5, rtol=0)
    for key, data in disk_before.items():  # A's entries untouched and intact
        path = DiskTier(home / "store").path(key)
        assert path.read_bytes() == data and decode(data).key == key
