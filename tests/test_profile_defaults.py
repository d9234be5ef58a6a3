"""A calibrated profile's defaults reach the paths when a request leaves the knob unset, and only then."""

from __future__ import annotations

from dataclasses import replace

import pytest

from semkv.profile import EngineDefaults
from semkv.request import DEFAULT_KV_BUDGET, GenerateRequest
from semkv.reuse.options import BlendConfig, ShareConfig
from semkv.sparse import Budget

LONG = " ".join(f"Item {i} of the list is the number {i * 7 % 13}." for i in range(30))


def test_kv_budget_falls_back_to_profile_then_default(make_tiny_engine):
    engine = make_tiny_engine("llama")
    request = GenerateRequest(prompt="hello", sparse="keykey")
    assert engine.defaults.kv_budget_for(request) == DEFAULT_KV_BUDGET
    engine.defaults = replace(engine.defaults, kv_budget={"keykey": 0.5})
    assert engine.defaults.kv_budget_for(request) == 0.5
    assert engine.defaults.kv_budget_for(GenerateRequest(prompt="hello", sparse="quest")) == DEFAULT_KV_BUDGET
    assert (
        engine.defaults.kv_budget_for(GenerateRequest(prompt="hello", sparse="keykey", kv_budget=0.2)) == 0.2
    )

    def used_budget(**options) -> float:
        """The budget a generation really decoded with: its stats, and the blocks it selected per step."""
        stats = engine.generate(
            prompt=LONG, max_new_tokens=4, stop_at_eos=False, store_prompt=False, **options
        ).stats
        lengths = [stats["prompt_tokens"] + 1 + step for step in range(3)]
        blocks = [Budget(stats["kv_budget"]).blocks(n, engine.config.block_size) for n in lengths]
        assert stats["blocks_selected_per_step"] == pytest.approx(sum(blocks) / len(blocks))
        return stats["kv_budget"]

    assert used_budget(sparse="keykey") == 0.5  # the profile's
    assert used_budget(sparse="keykey", kv_budget=0.2) == 0.2  # the request's own
    assert used_budget(sparse="quest") == DEFAULT_KV_BUDGET  # not in the profile
    engine.defaults = replace(engine.defaults, kv_budget={})
    assert used_budget(sparse="keykey") == DEFAULT_KV_BUDGET


def test_share_config_falls_back_to_profile():
    calibrated = ShareConfig(min_tokens=123)
    assert (
        EngineDefaults().reuse_options(GenerateRequest(prompt="x")).share.min_tokens
        == ShareConfig().min_tokens
    )
    defaults = EngineDefaults(share=calibrated)
    assert defaults.reuse_options(GenerateRequest(prompt="x")).share is calibrated
    explicit = ShareConfig(min_tokens=7)
    assert defaults.reuse_options(GenerateRequest(prompt="x", share=explicit)).share is explicit


def test_blend_config_falls_back_to_profile_and_ratio_applies_on_top():
    defaults = EngineDefaults(blend=BlendConfig(recompute_ratio=0.3, check_layer=2))
    assert defaults.reuse_options(GenerateRequest(prompt="x")).blend.recompute_ratio == 0.3
    on_top = defaults.reuse_options(GenerateRequest(prompt="x", recompute_ratio=0.1)).blend
    assert (on_top.recompute_ratio, on_top.check_layer) == (0.1, 2)
    own = defaults.reuse_options(GenerateRequest(prompt="x", blend={"selector": "query"})).blend
    assert (own.recompute_ratio, own.selector.name) == (BlendConfig().recompute_ratio, "query")
