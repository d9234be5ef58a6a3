"""``engine.generate(sparse=..., kv_budget=...)``: the request path through the engine.

Injected: sparse policies on a tiny engine (and one real SmolLM2 check). Must happen: a budget
covering every block gives the dense tokens; a small budget reports the stats (blocks selected
per step, resident KV bytes, bytes loaded, selection time and share) and attends to fewer blocks.
"""

from __future__ import annotations

import pytest

PROMPT = " ".join(f"word{i} is number {i * 7 % 13}." for i in range(40))


def _gen(engine, **kw):
    return engine.generate(
        PROMPT, max_new_tokens=8, stop_at_eos=False, reuse="none", store_prompt=False, **kw
    )


@pytest.mark.parametrize("policy", ["keykey", "h2o"])
def test_full_budget_matches_dense(make_tiny_engine, policy):
    engine = make_tiny_engine("llama", block_size=4)
    dense = _gen(engine)
    sparse = _gen(engine, sparse=policy, kv_budget=1.0)
    assert sparse.token_ids == dense.token_ids
    assert sparse.stats["sparse_policy"] == policy


def test_small_budget_reports_stats(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    g = _gen(engine, sparse="keykey", kv_budget=0.1)
    stats = g.stats
    for key in (
        "blocks_selected_per_step",
        "resident_kv_bytes",
        "bytes_loaded",
        "blocks_loaded_per_step",
        "select_s",
        "select_share",
    ):
        assert key in stats, key
    prompt_blocks = stats["prompt_tokens"] // 4
    assert 0 < stats["blocks_selected_per_step"] < prompt_blocks / 4
    assert stats["bytes_loaded"] > 0 and stats["resident_kv_bytes"] > 0
    assert "sparse_policy" not in _gen(engine).stats  # dense is the default


@pytest.mark.real_model
def test_smollm2_fast_tier_covering_every_block_matches_dense(smollm2):
    """SmolLM2 (fp16 KV): Key-Key + Quest hybrid through the fast tier with every block selected
    gives dense tokens and logits (the gather path, not the dense shortcut)."""
    import torch

    from semkv.models import Runtime, adapter_for
    from semkv.sparse import SparseConfig, SparseDecoder, make_policy

    runtime = Runtime(adapter_for("llama")(smollm2.hf_model), torch.float16)
    ids = smollm2.tokenizer(PROMPT)["input_ids"][:200]
    logits = {}
    for name, decoder in (
        ("dense", None),
        ("hybrid", SparseDecoder(make_policy("hybrid"), SparseConfig(1.0, dense_when_covered=False), 16)),
    ):
        cache = runtime.new_cache(len(ids) + 4)
        out = [runtime.prefill(cache, ids)]
        for _ in range(3):
            out.append(runtime.decode(cache, int(out[-1].argmax()), decoder))
        logits[name] = torch.stack(out)
    assert logits["hybrid"].argmax(-1).tolist() == logits["dense"].argmax(-1).tolist()
    # 30 layers of a different summation order (masked vs unmasked SDPA kernel): ~2e-4 on logits of ~20
    torch.testing.assert_close(logits["hybrid"], logits["dense"], atol=1e-3, rtol=0)
