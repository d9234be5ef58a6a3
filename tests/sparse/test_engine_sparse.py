"""``engine.generate(sparse=..., kv_budget=...)``: the request path through the engine.

Injected: sparse policies on a tiny engine (and one real SmolLM2 check). Must happen: a budget
covering every block gives the dense tokens; a small budget reports the stats (blocks selected
per step, resident KV bytes, bytes loaded, selection time and share) and attends to fewer blocks;
a request's ``sparse_reselect_every`` reaches its decoder (and its stats), a bad one is a ValueError
naming the field before anything runs.
"""

from __future__ import annotations

import pytest

from semkv.request import GenerateRequest
from semkv.sparse import Budget, SparseConfig, SparseDecoder, make_policy

PROMPT = " ".join(f"word{i} is number {i * 7 % 13}." for i in range(40))


def _gen(engine, **kw):
    return engine.generate(
        PROMPT, max_new_tokens=8, stop_at_eos=False, reuse="none", store_prompt=False, **kw
    )


@pytest.mark.parametrize("policy", ["keykey", "h2o"])
def test_full_budget_matches_dense(make_tiny_engine, policy):
    """kv_budget=1.0 through ``generate`` takes the dense shortcut (every step attends the whole cache);
    the same budget forced through the fast tier's gather path (a decoder with dense_when_covered=False,
    decoding a fork of the prefill) selects every candidate block and still gives the dense tokens."""
    engine = make_tiny_engine("llama", block_size=4)
    dense = _gen(engine)
    shortcut = _gen(engine, sparse=policy, kv_budget=1.0)
    assert shortcut.token_ids == dense.token_ids
    assert shortcut.stats["sparse_policy"] == policy
    assert shortcut.stats["bytes_loaded"] == 0  # the shortcut gathers nothing
    request = GenerateRequest(
        prompt=PROMPT, max_new_tokens=8, stop_at_eos=False, reuse="none", store_prompt=False
    )
    decoder = SparseDecoder(make_policy(policy), SparseConfig(1.0, dense_when_covered=False), 4)
    seq = engine.fork(engine.prefill(request, capture_queries=True), sparse=decoder)
    engine.decode(seq)
    gathered = engine.finish(seq)
    assert gathered.token_ids == dense.token_ids
    assert gathered.stats["bytes_loaded"] > 0 and len(decoder.records) == 7
    for record in decoder.records:  # every layer selected every candidate block
        candidates = (record.context_tokens - SparseConfig().window_tokens) // 4 - 1
        assert all(len(selected) == candidates for selected in record.selected)


def test_small_budget_reports_stats(make_tiny_engine):
    """Exact figures at budget 0.1 (block 4, 2 layers, 2 KV heads, d 16, KV float32: 1,024 bytes per block
    of one layer): blocks selected per step = the budget of each step's context; Key-Key stats present;
    for StreamingLLM, whose selection is known in advance (the latest candidate blocks), the bytes moved
    and resident too."""
    engine = make_tiny_engine("llama", block_size=4)
    layer_block = 2 * 2 * 4 * 16 * 4
    g = _gen(engine, sparse="keykey", kv_budget=0.1)
    stats = g.stats
    n = stats["prompt_tokens"]
    lengths = [n + 1 + step for step in range(7)]  # the cache at each of the 7 decode steps (new row in)
    budgets = [Budget(0.1).blocks(length, 4) for length in lengths]
    assert stats["sparse_steps"] == 7 and stats["kv_budget"] == 0.1
    assert stats["blocks_selected_per_step"] == pytest.approx(sum(budgets) / 7)
    assert stats["select_s"] > 0 and 0 < stats["select_share"] < 1
    assert stats["bytes_loaded"] % layer_block == 0 and stats["resident_kv_bytes"] % layer_block == 0
    assert "sparse_policy" not in _gen(engine).stats  # dense is the default

    streaming = _gen(engine, sparse="streaming", kv_budget=0.1).stats
    window = SparseConfig().window_tokens
    selected = []  # the latest `budget` candidate blocks, just before the window
    for length, budget in zip(lengths, budgets, strict=True):
        first_window_block = (length - window) // 4
        selected.append(set(range(first_window_block - budget, first_window_block)))
    copies = len(selected[0]) + sum(
        len(now - before) for before, now in zip(selected, selected[1:], strict=False)
    )
    assert streaming["bytes_loaded"] == 2 * copies * layer_block  # a per-step policy copies to both layers
    assert streaming["resident_kv_bytes"] == 2 * len(selected[-1]) * layer_block
    assert streaming["blocks_selected_per_step"] == pytest.approx(sum(budgets) / 7)


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


@pytest.mark.parametrize("period", [None, 1, 3])
def test_request_reselection_period_reaches_the_decoder(make_tiny_engine, period):
    """The request's period is the decoder's ``reselect_every`` (None: the decoder default, 4): its stats
    say so, and the policy chose at most every ``period``-th step (once per step with 1: the seed's
    per-step Key-Key)."""
    engine = make_tiny_engine("llama", block_size=4)
    request = GenerateRequest(
        prompt=PROMPT,
        max_new_tokens=13,
        stop_at_eos=False,
        reuse="none",
        store_prompt=False,
        sparse="keykey",
        kv_budget=0.1,
        sparse_reselect_every=period,
    )
    seq = engine.prefill(request)
    assert seq.sparse is not None
    expected = SparseConfig().reselect_every if period is None else period
    assert seq.sparse.config.reselect_every == expected
    engine.decode(seq)
    stats = engine.finish(seq).stats
    assert stats["sparse_reselect_every"] == expected
    steps = stats["sparse_steps"]
    chosen = sum(1 for record in seq.sparse.records if record.select_s > 0)
    if period == 1:
        assert chosen == steps == 12
    else:  # reused on some steps; at least once per period
        assert -(-steps // expected) <= chosen < steps


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", 10**6])
def test_bad_reselection_period_is_refused(bad):
    with pytest.raises(ValueError, match="sparse_reselect_every"):
        GenerateRequest(prompt=PROMPT, sparse="keykey", sparse_reselect_every=bad)
