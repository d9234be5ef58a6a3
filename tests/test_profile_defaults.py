"""A calibrated profile's defaults reach the paths when a request leaves the knob unset, and only then."""

from __future__ import annotations

from semkv.request import DEFAULT_KV_BUDGET, GenerateRequest
from semkv.reuse.share import ShareConfig, share_config_of


def test_kv_budget_falls_back_to_profile_then_default(make_tiny_engine):
    engine = make_tiny_engine("llama")
    request = GenerateRequest(prompt="hello", sparse="keykey")
    assert engine.kv_budget_for(request) == DEFAULT_KV_BUDGET
    engine.ctx.settings["kv_budget"] = {"keykey": 0.5}
    assert engine.kv_budget_for(request) == 0.5
    assert engine.kv_budget_for(GenerateRequest(prompt="hello", sparse="quest")) == DEFAULT_KV_BUDGET
    assert engine.kv_budget_for(GenerateRequest(prompt="hello", sparse="keykey", kv_budget=0.2)) == 0.2
    generation = engine.generate(prompt="hello there", sparse="keykey", max_new_tokens=3, stop_at_eos=False)
    assert len(generation.token_ids) == 3


def test_share_config_falls_back_to_profile():
    calibrated = ShareConfig(min_tokens=123)
    assert share_config_of(GenerateRequest(prompt="x")).min_tokens == ShareConfig().min_tokens
    assert share_config_of(GenerateRequest(prompt="x"), {"share": calibrated}) is calibrated
    explicit = ShareConfig(min_tokens=7)
    assert share_config_of(GenerateRequest(prompt="x", share=explicit), {"share": calibrated}) is explicit
