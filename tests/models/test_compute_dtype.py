"""The compute dtype: choosing it, bad input, the private cast copy, and reuse across dtypes.

* "auto" picks bf16 exactly where torch reports fast bf16 (the hardware probes are switched off to
  play a CPU without it); a bf16 request on such a CPU runs and says so in one warning;
* an unknown compute dtype is a ValueError naming the choices (config and resolver);
* a bf16 runtime runs a private bf16 copy: the caller's fp32 model is untouched, and the copy's
  q/k/v and gate/up modules are views of the stacked matrices (no second copy of the weights);
* entries stored under one compute dtype are a miss under another (the fingerprint covers it), and
  fp32 fingerprints are the ones made before the setting existed;
* a block reused under bf16 is bit-identical to the rows the storing prefill computed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.models import Runtime, adapter_for, model_fingerprint
from semkv.models.precision import COMPUTE_DTYPE_CHOICES, fast_dtype, resolve_compute_dtype
from semkv.request import GenerateRequest
from tests.conftest import tiny_hf_model

PROMPT = "The committee met on Tuesday to review the budget for the new library and its reading room."


@pytest.fixture
def no_fast_bf16(monkeypatch):
    """A CPU without AVX512-BF16 / AMX, as torch's probes would report it."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False, raising=False)


def test_auto_follows_the_hardware_probe(no_fast_bf16):
    assert resolve_compute_dtype("auto") == torch.float32
    assert resolve_compute_dtype("float32") == torch.float32


@pytest.mark.skipif(not fast_dtype(torch.bfloat16), reason="this CPU has no fast bf16")
def test_auto_is_bf16_on_this_cpu():
    assert resolve_compute_dtype("auto") == torch.bfloat16


@pytest.mark.parametrize("bad", ["int8", "fp16", "", None, 16])
def test_unknown_compute_dtype_is_a_value_error(bad, tmp_path):
    with pytest.raises(ValueError, match="compute_dtype must be one of") as info:
        EngineConfig(home=tmp_path, compute_dtype=bad)
    assert all(choice in str(info.value) for choice in COMPUTE_DTYPE_CHOICES)
    with pytest.raises(ValueError, match="compute_dtype"):
        resolve_compute_dtype(bad)


def test_bf16_without_fast_hardware_runs_and_warns_once(no_fast_bf16, make_tiny_engine):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_tiny_engine("llama", disk=False, compute_dtype="bfloat16")
    emulated = [w for w in caught if "emulated" in str(w.message)]
    assert len(emulated) == 1 and issubclass(emulated[0].category, RuntimeWarning)
    assert engine.runtime.compute_dtype == torch.bfloat16
    assert engine.generate(prompt=PROMPT, max_new_tokens=3, stop_at_eos=False).token_ids


def test_bf16_runtime_runs_a_private_copy(tokenizer):
    model = tiny_hf_model("qwen2", len(tokenizer))  # with q/k/v biases
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    runtime = Runtime(adapter_for("qwen2")(model), torch.float32, torch.bfloat16)
    for name, p in model.named_parameters():  # the caller's model: untouched
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name
    copy = runtime.adapter.hf_model
    assert copy is not model and {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    cache = runtime.new_cache(16)
    runtime.prefill(cache, list(range(5, 17)))
    assert cache.keys(0).dtype == torch.bfloat16 and cache.values(0).dtype == torch.bfloat16
    attn = copy.model.layers[0].self_attn
    stacked = runtime.adapter.weights[0].qkv.weight
    for module in (attn.q_proj, attn.k_proj, attn.v_proj):  # views of the stacked matrix, not copies
        assert module.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    assert torch.equal(attn.k_proj.weight, before["model.layers.0.self_attn.k_proj.weight"].bfloat16())


def test_fingerprint_covers_the_compute_dtype(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    fp32 = model_fingerprint(model, tokenizer, torch.float16, torch.float32)
    bf16 = model_fingerprint(model, tokenizer, torch.float16, torch.bfloat16)
    assert fp32 != bf16
    assert fp32 == model_fingerprint(model, tokenizer, torch.float16)  # fp32: as before the setting


def _engine(home, model, tokenizer, compute_dtype: str) -> Engine:
    config = EngineConfig(
        model="llama",
        home=home,
        kv_dtype="float16",
        block_size=4,
        store=StoreConfig(),
        compute_dtype=compute_dtype,
    )
    return Engine(config, model, tokenizer, name=f"tiny-{compute_dtype}")


def test_entries_of_another_compute_dtype_are_a_miss(tmp_path, tokenizer):
    """Blocks a bf16 engine stored on disk are not reused by an fp32 engine on the same home (nor the
    other way round); each engine reuses its own."""
    model = tiny_hf_model("llama", len(tokenizer))
    request = dict(prompt=PROMPT, max_new_tokens=2, stop_at_eos=False)
    bf16 = _engine(tmp_path, model, tokenizer, "bfloat16")
    bf16.generate(**request)
    bf16.close()
    fp32 = _engine(tmp_path, model, tokenizer, "float32")
    assert fp32.generate(**request).stats["reused_tokens"] == 0  # stores its own blocks
    again = _engine(tmp_path, model, tokenizer, "bfloat16")
    assert again.generate(**request).stats["reused_tokens"] > 0
    assert _engine(tmp_path, model, tokenizer, "float32").generate(**request).stats["reused_tokens"] > 0


def test_reused_blocks_are_bit_identical_under_bf16(make_tiny_engine):
    """Prefix reuse under bf16 compute and fp16 KV: the reused rows of the live cache (pre-RoPE keys at
    rest, rotated keys and values as attention reads them) are the bits the storing prefill wrote."""
    engine = make_tiny_engine("llama", kv_dtype="float16", compute_dtype="bfloat16", disk=False)
    first = engine.prefill(GenerateRequest(prompt=PROMPT, max_new_tokens=1))
    engine.store_prefill(first)
    longer = engine.prefill(GenerateRequest(prompt=PROMPT + " What did they decide?", max_new_tokens=1))
    reused = longer.outcome.reused_tokens
    assert longer.outcome.path == "prefix" and reused > 0
    a, b = first.cache, longer.cache
    for layer in range(a.num_layers):
        for mine, theirs in ((a.k_pre, b.k_pre), (a.k_rot, b.k_rot), (a.v, b.v)):
            assert torch.equal(mine[layer][:, :reused], theirs[layer][:, :reused]), layer
