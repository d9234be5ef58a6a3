"""Gemma 3: the adapter reproduces HF (tiny config and the embedded 270M model, beyond its 512 window).

Tiny-config checks of the family's mechanics (q/k norms before RoPE, per-layer-type
rotary, window masks) run by default; the real-model checks are marked ``real_model``.
"""

from __future__ import annotations

import pytest
import torch

from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.evaluation.essays import haystack
from semkv.models import Runtime, adapter_for
from semkv.models.gemma3 import Gemma3Adapter
from semkv.request import GenerateRequest
from tests.conftest import require_embedded, tiny_hf_model


def _runtime(model) -> Runtime:
    return Runtime(adapter_for(model.config.model_type)(model), torch.float32)


def test_adapter_reads_the_config(tokenizer):
    model = tiny_hf_model("gemma3_text", len(tokenizer))
    adapter = adapter_for("gemma3_text")(model)
    assert isinstance(adapter, Gemma3Adapter)
    assert [adapter.window(i) for i in range(2)] == [8, None]
    assert adapter.scaling(0) == pytest.approx(24**-0.5)  # query_pre_attn_scalar, not head_dim
    positions = torch.arange(5)
    like = torch.zeros(1, dtype=torch.float32)
    local, glob = adapter.rotary(positions, 0, like), adapter.rotary(positions, 1, like)
    assert not torch.allclose(local[0], glob[0])  # local base (100) vs global base (10000)


def test_pre_rope_keys_rerotate_exactly(tokenizer):
    """The cached pre-RoPE key is the key after k_norm: keys computed at positions 0.. and
    re-rotated to 50.. equal keys computed at 50.. (the precondition of chunk reuse)."""
    model = tiny_hf_model("gemma3_text", len(tokenizer))
    runtime = _runtime(model)
    ids = torch.randint(0, len(tokenizer), (12,), generator=torch.Generator().manual_seed(4)).tolist()
    at_zero, at_fifty = runtime.new_cache(12), runtime.new_cache(12)
    runtime.prefill(at_zero, ids)
    runtime.prefill(at_fifty, ids, positions=torch.arange(50, 62))
    k_pre, v = at_zero.export(0, 12)
    moved = runtime.new_cache(12)
    runtime.load_rows(moved, k_pre, v, torch.arange(50, 62), ids)
    for layer in range(2):
        torch.testing.assert_close(moved.keys(layer), at_fifty.keys(layer), atol=1e-5, rtol=0)
        torch.testing.assert_close(moved.values(layer), at_fifty.values(layer), atol=1e-6, rtol=0)


def test_window_layer_ignores_keys_beyond_the_window(tokenizer):
    """One sliding layer (window 8): editing a token 24 positions back leaves the last logits
    bit-identical; editing one inside the window changes them."""
    model = tiny_hf_model(
        "gemma3_text", len(tokenizer), num_hidden_layers=1, layer_types=["sliding_attention"]
    )
    runtime = _runtime(model)
    ids = torch.randint(3, len(tokenizer), (30,), generator=torch.Generator().manual_seed(5)).tolist()

    def last_logits(tokens: list[int]) -> torch.Tensor:
        return runtime.prefill(runtime.new_cache(len(tokens)), tokens)

    reference = last_logits(ids)
    far, near = list(ids), list(ids)
    far[5], near[25] = 0, 0
    torch.testing.assert_close(last_logits(far), reference, atol=0, rtol=0)
    assert not torch.allclose(last_logits(near), reference)


# -- the embedded Gemma 3 270M -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_engine():
    """`Engine.from_pretrained(model="gemma3-270m")` (converted once into the default home; no disk store)."""
    require_embedded("gemma3-270m")
    torch.set_num_threads(2)
    engine = Engine.from_pretrained(model="gemma3-270m", store=StoreConfig(disk=False))
    yield engine
    engine.close()


@pytest.mark.real_model
def test_gemma3_270m_matches_hf_beyond_the_window(gemma3_engine):
    """A 561-token prompt (> the 512 window): last logits (fp32, atol 1e-4), a split prefill, and 8
    greedy tokens equal HF's."""
    model, tok = gemma3_engine.hf_model, gemma3_engine.tokenizer
    ids = [tok.bos_token_id] + tok(haystack(tok, 560), add_special_tokens=False)["input_ids"]
    runtime = _runtime(model)
    with torch.no_grad():
        reference = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    cache = runtime.new_cache(len(ids) + 8)
    logits = runtime.prefill(cache, ids)
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    split = runtime.new_cache(len(ids))
    runtime.prefill(split, ids[:530])
    torch.testing.assert_close(runtime.prefill(split, ids[530:]), reference, atol=1e-4, rtol=0)
    expected = model.generate(
        torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
    )[0, len(ids) :].tolist()
    ours = []
    for _ in range(8):
        ours.append(int(logits.argmax()))
        logits = runtime.decode(cache, ours[-1])
    assert ours == expected


@pytest.mark.real_model
def test_engine_generates_hf_greedy_tokens(gemma3_engine):
    """The engine over the embedded model: BOS first (base model, no chat template), HF's greedy tokens."""
    engine = gemma3_engine
    assert engine.adapter.__class__ is Gemma3Adapter
    prompt = "The capital of France is"
    g = engine.generate(prompt=prompt, max_new_tokens=6, stop_at_eos=False, reuse="none")
    prompt_ids = engine.layout(GenerateRequest(prompt=prompt)).token_ids
    assert prompt_ids[0] == engine.tokenizer.bos_token_id
    expected = engine.hf_model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
    )[0, len(prompt_ids) :].tolist()
    assert g.token_ids == expected


@pytest.mark.real_model
def test_gemma3_blend_at_full_ratio_equals_full_prefill_beyond_the_window(gemma3_engine, tmp_path):
    """Two ~280-token chunks blended at new positions (the prompt passes the 512 window) with
    every row recomputed give the full-prefill logits and tokens (KV fp32)."""
    base = gemma3_engine
    config = EngineConfig(
        model="gemma3-270m",
        home=tmp_path,
        kv_dtype="float32",
        store=StoreConfig(disk=False),
        compute_dtype="float32",
    )
    engine = Engine(config, base.hf_model, base.tokenizer, name="gemma3-270m")
    tok = engine.tokenizer
    ids = tok(haystack(tok, 560), add_special_tokens=False)["input_ids"]
    chunks = [tok.decode(ids[:280]), tok.decode(ids[280:])]
    engine.add_chunks(chunks)
    question = "What is the essay about?"
    kw = dict(prompt=question, chunks=chunks, max_new_tokens=4, stop_at_eos=False, store_prompt=False)
    full = engine.generate(reuse="none", **kw)
    blend = engine.generate(reuse="blend", recompute_ratio=1.0, **kw)
    assert blend.stats["path"] == "blend" and blend.stats["prompt_tokens"] > 512
    torch.testing.assert_close(blend.first_logits, full.first_logits, atol=1e-4, rtol=0)
    assert blend.token_ids == full.token_ids
