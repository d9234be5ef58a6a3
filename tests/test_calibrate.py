"""The per-model quality gate: choosing defaults, the profile file, the engine using it.

Tiny random models check the mechanics (a tiny model's quality figures mean nothing);
the exact ends of each sweep (blend at ratio 1.0, sparse at budget 1.0) must measure
zero divergence, which checks the measuring itself.
"""

from __future__ import annotations

import json
import logging

import pytest

from semkv.calibrate import CalibrationConfig, calibrate, choose_auto, format_profile, smallest_passing
from semkv.cli import build_parser
from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.profile import check_request, load_profile, profile_path, write_profile
from semkv.request import GenerateRequest
from semkv.reuse.options import BlendConfig


def _pts(*pairs):
    return [{"value": v, "top1_agreement": a} for v, a in pairs]


def test_smallest_passing_value():
    assert smallest_passing(_pts((0.0, 0.5), (0.1, 0.95), (0.3, 1.0)), 0.9) == (0.1, True)
    # a pass below a failure does not count: agreement must hold for every larger value too
    assert smallest_passing(_pts((0.0, 1.0), (0.1, 0.8), (0.3, 0.9), (0.5, 1.0)), 0.9) == (0.3, True)
    # nothing passes: the largest value measured, flagged
    assert smallest_passing(_pts((0.1, 0.2), (0.5, 0.5)), 0.9) == (0.5, False)
    assert smallest_passing(_pts((0.1, None)), 0.9) == (None, False)


def test_config_validation():
    with pytest.raises(ValueError, match="ratios must be non-empty, in"):
        CalibrationConfig(ratios=(1.5,))
    with pytest.raises(ValueError, match="budgets must be non-empty fractions"):
        CalibrationConfig(budgets=(0.0,))
    with pytest.raises(ValueError, match="techniques must be among blend, share, sparse"):
        CalibrationConfig(techniques=("magic",))
    with pytest.raises(ValueError, match="context_tokens must be >= 64"):
        CalibrationConfig(context_tokens=32)
    assert CalibrationConfig(ratios=(0.3, 0.1)).ratios == (0.1, 0.3)


def _profile(engine, blend=0.3, share=0.2, budgets=None):
    return {
        "version": 1,
        "model": engine.name,
        "fingerprint": engine.fingerprint,
        "target": 0.9,
        "defaults": {
            "blend_recompute_ratio": blend,
            "share_ratio": share,
            "kv_budget": budgets or {"keykey": 0.2},
        },
        "met_target": {},
        "measurements": {},
    }


def _reopen(engine) -> Engine:
    """A new engine over the same model and home (loads the profile at start)."""
    return Engine(engine.config, engine.hf_model, engine.tokenizer, name=engine.name)


def test_engine_uses_the_profile_and_warns_below_it(make_tiny_engine, caplog):
    engine = make_tiny_engine("llama", disk=False)
    assert engine.defaults.profile is None
    write_profile(engine.config.home_path, _profile(engine))
    engine = _reopen(engine)
    assert engine.defaults.blend.recompute_ratio == 0.3
    assert engine.defaults.share.first_ratio == 0.2
    chunks = ["A short text about the sea and the boats in the harbour.", "Another text about mountains."]
    engine.add_chunks(chunks)
    g = engine.generate(prompt="Where are the boats?", chunks=chunks, reuse="blend", max_new_tokens=2)
    assert g.stats["path"] == "blend" and g.stats["recompute_ratio"] == 0.3  # the profile's default
    with caplog.at_level(logging.WARNING, logger="semkv.profile"):
        low = engine.generate(
            prompt="Where are the boats?", chunks=chunks, reuse="blend", recompute_ratio=0.1, max_new_tokens=2
        )
    assert low.stats["recompute_ratio"] == 0.1  # a request's own setting still wins
    assert any("recompute_ratio 0.1 is below" in r.message for r in caplog.records)
    settings = engine.defaults
    assert check_request(settings, GenerateRequest(prompt="x", reuse="blend", recompute_ratio=0.5)) == []
    assert check_request(settings, GenerateRequest(prompt="x", sparse="keykey", kv_budget=0.05))
    assert check_request(settings, GenerateRequest(prompt="x", sparse="keykey", kv_budget=0.5)) == []


def _default_blend(engine) -> dict:
    """The blend a request that names no selector and no ratio gets: its stats' selector and ratio."""
    chunks = ["A short text about the sea and the boats in the harbour.", "Another text about mountains."]
    engine.add_chunks(chunks)
    g = engine.generate(prompt="Where are the boats?", chunks=chunks, reuse="blend", max_new_tokens=1)
    assert g.stats["path"] == "blend"
    return {k: g.stats[k] for k in ("selector", "recompute_ratio", "check_layer")}


def test_the_engine_blends_with_the_profile_selector_or_the_default(make_tiny_engine):
    """The selector a blend request without one runs with: the built-in default (query, at layer 0)
    without a profile; a profile's ratio with the selector it was measured with; a profile from before
    selectors with deviation (its ratio was measured with it), at deviation's check layer 1."""
    engine = make_tiny_engine("llama", disk=False)
    assert _default_blend(engine) == {
        "selector": BlendConfig().selector.describe(),
        "recompute_ratio": BlendConfig().recompute_ratio,
        "check_layer": 0,
    }
    assert BlendConfig().selector.name == "query"
    profile = _profile(engine)
    profile["defaults"]["blend_selector"] = {"name": "chunk-start", "k": 8, "temperature": 1.0, "scale": 1.0}
    write_profile(engine.config.home_path, profile)
    used = _default_blend(_reopen(engine))
    assert used["selector"] == profile["defaults"]["blend_selector"] and used["recompute_ratio"] == 0.3
    write_profile(engine.config.home_path, _profile(engine))
    used = _default_blend(_reopen(engine))
    assert (used["selector"]["name"], used["recompute_ratio"], used["check_layer"]) == ("deviation", 0.3, 1)


def test_profile_of_another_fingerprint_or_damaged_is_ignored(make_tiny_engine, caplog):
    engine = make_tiny_engine("llama", disk=False)
    home = engine.config.home_path
    other = _profile(engine)
    other["fingerprint"] = "0" * 64
    write_profile(home, other)
    assert load_profile(home, engine.fingerprint) is None
    path = profile_path(home, engine.fingerprint)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="semkv.profile"):
        reopened = _reopen(engine)
    assert reopened.defaults.profile is None
    assert any("unreadable calibration profile" in r.message for r in caplog.records)


def test_calibrate_measures_every_technique(make_tiny_engine):
    """On a tiny model: every technique measured; the exact ends of the sweeps measure zero divergence."""
    engine = make_tiny_engine("llama", disk=False, block_size=16)
    config = CalibrationConfig(
        cases=1,
        context_tokens=160,
        chunks=2,
        ratios=(0.0, 1.0),
        budgets=(0.1, 1.0),
        policies=("keykey", "streaming"),
        decode_steps=3,
        sparse_context_tokens=512,
    )
    profile = calibrate(engine, config, show_progress=False)
    m = profile["measurements"]
    blend_full = next(p for p in m["blend"] if p["value"] == 1.0)
    # first token + 3 teacher-forced steps of the one case
    assert blend_full["n"] == 4 and blend_full["kl_mean"] < 1e-6 and blend_full["top1_agreement"] == 1.0
    assert blend_full["first_token_top1"] == 1.0 and blend_full["first_token_kl_mean"] < 1e-6
    # share: the one case served at every ratio (a refusal would measure nothing); ratio 1.0 recomputes
    # every reused row (2 layers: layer 1 is the only scheduled one), so it is exact
    assert [(p["value"], p["n"], p["refused"]) for p in m["share"]] == [(0.0, 4, 0), (1.0, 4, 0)]
    share_full = m["share"][-1]
    assert share_full["kl_mean"] < 1e-6 and share_full["top1_agreement"] == 1.0
    for policy in ("keykey", "streaming"):
        dense = next(p for p in m["sparse"][policy] if p["value"] == 1.0)
        assert dense["n"] == 3 and dense["kl_mean"] < 1e-6 and dense["top1_agreement"] == 1.0
    assert profile["fingerprint"] == engine.fingerprint
    assert set(profile["defaults"]["kv_budget"]) == {"keykey", "streaming"}
    assert profile["defaults"]["blend_selector"] == BlendConfig().selector.describe()
    assert "sparse keykey" in format_profile(profile)
    path = write_profile(engine.config.home_path, profile)
    assert json.loads(path.read_text())["defaults"] == profile["defaults"]
    assert load_profile(engine.config.home_path, engine.fingerprint).data["defaults"] == profile["defaults"]


def test_sparse_calibration_on_a_model_with_window_layers_chooses_auto(make_tiny_engine):
    """Gemma 3 tiny (window 8): sparse measured on RULER-style cases (window layers on their window),
    exact at full budget, and sparse_auto names a policy that passed (or dense, saying why)."""
    engine = make_tiny_engine("gemma3_text", disk=False, block_size=4)
    config = CalibrationConfig(
        cases=2,
        budgets=(0.2, 1.0),
        policies=("probe", "keykey"),
        decode_steps=3,
        techniques=("sparse",),
        sparse_context_tokens=512,
        auto_min_context=123,
        auto_min_new_tokens=7,
    )
    profile = calibrate(engine, config, show_progress=False)
    for policy in ("probe", "keykey"):
        full = profile["measurements"]["sparse"][policy][-1]
        assert full["n"] == 6 and full["kl_mean"] < 1e-6 and full["top1_agreement"] == 1.0
    auto = profile["defaults"]["sparse_auto"]
    assert auto["policy"] in ("probe", "keykey") and auto["min_context"] == 123
    assert auto["min_new_tokens"] == 7
    assert auto["kv_budget"] == profile["defaults"]["kv_budget"][auto["policy"]]
    assert "sparse='auto'" in format_profile(profile)


def test_choose_auto_prefers_the_smallest_passing_budget():
    config = CalibrationConfig(budgets=(0.1, 0.2, 0.5), target=0.9)

    def points(*agreements):
        return [{"value": b, "top1_agreement": a} for b, a in zip(config.budgets, agreements, strict=True)]

    chosen = choose_auto({"keykey": points(0.5, 0.92, 0.95), "probe": points(0.91, 0.93, 0.99)}, config)
    assert (chosen["policy"], chosen["kv_budget"]) == ("probe", 0.1)
    tie = choose_auto({"keykey": points(0.5, 0.95, 0.99), "probe": points(0.5, 0.93, 0.99)}, config)
    assert (tie["policy"], tie["kv_budget"]) == ("keykey", 0.2)
    none = choose_auto({"keykey": points(0.1, 0.2, 0.3)}, config)
    assert none["policy"] is None and "dense" in none["reason"]


def test_cli_registers_calibrate():
    args = build_parser().parse_args(["calibrate", "--model", "x", "--ratios", "0.1,0.2", "--dry-run"])
    assert args.ratios == (0.1, 0.2) and args.dry_run and args.func.__name__ == "cmd_calibrate"


def test_engine_config_home_is_where_profiles_live(tmp_path):
    config = EngineConfig(home=tmp_path, store=StoreConfig(disk=False))
    assert profile_path(config.home_path, "ab").parent == tmp_path / "profiles"
