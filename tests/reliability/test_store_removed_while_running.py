"""The store folder removed under a running engine (``semkv cache clear``, or a cleaner) is survived.

Injected: an engine has stored a prompt; the whole ``store`` folder is deleted (through the same
code as ``semkv cache clear``) while the engine keeps running; the engine then serves the stored
prompt again and a new one.

Must happen: no request fails; outputs equal cache-less runs; the folder is recreated by the next
write; the prompt the engine still holds in memory is written back to disk, so a fresh engine on the
same home reuses it from disk.
"""

from __future__ import annotations

import torch

from semkv.store.cache_admin import cache_command
from semkv.store.tiers import DiskTier
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import PROMPT, block_keys_of, engine_at

NEW = "A new prompt after the store folder vanished."


def test_engine_survives_its_store_folder_vanishing(tmp_path, tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    ref_engine = engine_at(tmp_path / "ref", tokenizer, model, disk=False)
    refs = {
        p: ref_engine.generate(p, max_new_tokens=2, reuse="none", store_prompt=False) for p in (PROMPT, NEW)
    }
    home = tmp_path / "home"
    engine = engine_at(home, tokenizer, model)
    engine.generate(PROMPT, max_new_tokens=2)

    assert cache_command("clear", home)["existed"]
    assert not (home / "store").exists()
    for prompt in (PROMPT, NEW):
        g = engine.generate(prompt, max_new_tokens=2)
        assert g.token_ids == refs[prompt].token_ids
        torch.testing.assert_close(g.first_logits, refs[prompt].first_logits, atol=1e-5, rtol=0)
    disk = DiskTier(home / "store")
    assert all(disk.path(k).is_file() for k in block_keys_of(engine, PROMPT))  # written back

    fresh = engine_at(home, tokenizer, model)
    g = fresh.generate(PROMPT, max_new_tokens=2)
    assert g.token_ids == refs[PROMPT].token_ids and g.stats["reused_tokens"] > 0
    assert fresh.store.tier("disk").stats.hits > 0
