"""Calibrated profiles shipped in the package (``semkv/profiles/``), looked up after the user's own.

Injected: the package's profile files; a shipped folder (monkeypatched) holding a profile for a tiny
engine's fingerprint whose ``sparse_auto`` names the probe with ``split_at`` and a budget floor, with and
without a profile of the same fingerprint in the user's home; prompts above and below the profile's
``min_context`` and requests allowing fewer new tokens than its ``min_new_tokens``; a shipped profile that
names an unknown policy option or a bad floor.
Must happen: every shipped file is a valid profile for the fingerprint it is named after, with a
``sparse_auto`` entry that says why; the package data includes them; without a home profile the engine
takes the shipped one and ``sparse="auto"`` decodes with its policy, options and floor, the notes naming
the shipped profile; below ``min_context`` or ``min_new_tokens`` it decodes dense and says why; a home profile wins over the
shipped one; a shipped profile with a bad option is ignored with a warning (auto decodes dense).
"""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path

import pytest

import semkv.profile as profile_module
from semkv.engine import Engine
from semkv.profile import (
    defaults_from_profile,
    find_profile,
    load_shipped_profile,
    shipped_profile_folder,
    write_profile,
)
from semkv.request import GenerateRequest

PROMPT = " ".join(f"Row {i}: the valve reads {i * 13 % 29} bar." for i in range(40))
ROOT = Path(__file__).resolve().parents[1]


def _auto_profile(fingerprint: str, auto: dict) -> dict:
    return {
        "version": 1,
        "model": "tiny",
        "fingerprint": fingerprint,
        "target": 0.9,
        "defaults": {"sparse_auto": auto},
    }


PROBE_AUTO = {
    "policy": "probe",
    "kv_budget": 0.1,
    "min_context": 64,
    "min_kept_tokens": 16,
    "min_new_tokens": 3,
    "options": {"split_at": [1]},
    "reason": "chosen on the dev split",
}


def test_every_shipped_profile_is_valid():
    files = sorted(shipped_profile_folder().glob("*.json"))
    assert len(files) >= 2  # both embedded models
    models = set()
    for path in files:
        profile = load_shipped_profile(path.stem)
        assert profile is not None and profile.shipped, path
        assert profile.sparse_auto is not None and profile.sparse_auto.reason, path
        profile.sparse_auto.policy_object()  # builds with its options
        models.add(json.loads(path.read_text())["model"])
    assert {"smollm2-135m", "gemma3-270m"} <= models


def test_package_data_ships_the_profiles():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.json" in pyproject["tool"]["setuptools"]["package-data"]["semkv.profiles"]


def _engine_with_shipped(make_tiny_engine, monkeypatch, tmp_path, auto: dict) -> Engine:
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / f"{engine.fingerprint}.json").write_text(json.dumps(_auto_profile(engine.fingerprint, auto)))
    monkeypatch.setattr(profile_module, "shipped_profile_folder", lambda: shipped)
    return Engine(engine.config, engine.hf_model, engine.tokenizer, name=engine.name)


def _gen(engine: Engine, prompt: str = PROMPT, max_new_tokens: int = 4):
    return engine.generate(
        prompt, max_new_tokens=max_new_tokens, stop_at_eos=False, reuse="none", store_prompt=False
    )


def test_shipped_profile_drives_auto(make_tiny_engine, monkeypatch, tmp_path):
    engine = _engine_with_shipped(make_tiny_engine, monkeypatch, tmp_path, PROBE_AUTO)
    assert engine.defaults.profile is not None and engine.defaults.profile.shipped
    g = _gen(engine)
    assert g.stats["sparse_policy"] == "probe" and g.stats["kv_budget"] == 0.1
    assert g.stats["sparse_min_kept_tokens"] == 16
    assert "shipped profile" in g.stats["sparse_auto"] and "dev split" in g.stats["sparse_auto"]
    short = _gen(engine, "Row 1: the valve reads 3 bar.")
    assert "sparse_policy" not in short.stats
    assert "< 64" in short.stats["sparse_auto"] and "dense decoding" in short.stats["sparse_auto"]
    brief = _gen(engine, max_new_tokens=2)  # too few steps for the set-up to pay back
    assert "sparse_policy" not in brief.stats
    assert "max_new_tokens 2 < 3" in brief.stats["sparse_auto"]


def test_auto_policy_gets_the_profiles_options(make_tiny_engine, monkeypatch, tmp_path):
    engine = _engine_with_shipped(make_tiny_engine, monkeypatch, tmp_path, PROBE_AUTO)
    resolved = engine.resolve(engine_request(PROMPT))
    assert resolved.sparse_policy.split_at == (1,)
    assert resolved.sparse_config == {"min_kept_tokens": 16}


def engine_request(prompt: str):
    return GenerateRequest(prompt=prompt, max_new_tokens=8, reuse="none", store_prompt=False)


def test_home_profile_wins(make_tiny_engine, monkeypatch, tmp_path):
    engine = _engine_with_shipped(make_tiny_engine, monkeypatch, tmp_path, PROBE_AUTO)
    home_auto = {"policy": "keykey", "kv_budget": 0.25, "reason": "the user's own calibration"}
    write_profile(engine.config.home_path, _auto_profile(engine.fingerprint, home_auto))
    found = find_profile(engine.config.home_path, engine.fingerprint)
    assert found is not None and not found.shipped
    g = _gen(Engine(engine.config, engine.hf_model, engine.tokenizer, name=engine.name))
    assert g.stats["sparse_policy"] == "keykey" and g.stats["kv_budget"] == 0.25
    assert "the user's own calibration" in g.stats["sparse_auto"]


def test_bad_shipped_option_is_ignored(make_tiny_engine, monkeypatch, tmp_path, caplog):
    bad = {**PROBE_AUTO, "options": {"split_after": [1]}}
    with caplog.at_level(logging.WARNING, logger="semkv.profile"):
        engine = _engine_with_shipped(make_tiny_engine, monkeypatch, tmp_path, bad)
    assert any("malformed calibration profile" in r.message for r in caplog.records)
    g = _gen(engine)
    assert "sparse_policy" not in g.stats and "no calibrated profile" in g.stats["sparse_auto"]


@pytest.mark.parametrize("floor", [-1, 2.5])
def test_bad_floor_is_ignored(make_tiny_engine, monkeypatch, tmp_path, floor):
    engine = _engine_with_shipped(
        make_tiny_engine, monkeypatch, tmp_path, {**PROBE_AUTO, "min_kept_tokens": floor}
    )
    assert engine.defaults.profile is None


def _shipped(model: str, compute_dtype: str):
    for path in sorted(shipped_profile_folder().glob("*.json")):
        data = json.loads(path.read_text())
        if data["model"] == model and data["compute_dtype"] == compute_dtype:
            return load_shipped_profile(path.stem)
    raise AssertionError(f"no shipped profile for {model} ({compute_dtype})")


def test_shipped_smollm2_sparse_engages_only_where_it_was_measured():
    """The SmolLM2 bf16 profile's auto decodes with the probe at 8K, where it held on RULER's dev and
    test splits, and dense at 4K, where the same policy lost on the test split, or for short answers."""
    defaults = defaults_from_profile(_shipped("smollm2-135m", "bfloat16"))
    request = GenerateRequest(prompt="q", max_new_tokens=64)
    policy, budget, notes, _ = defaults.resolve_sparse(request, prompt_tokens=7923)
    assert policy is not None and policy.name == "probe" and policy.rescore == 3 and budget == 0.1
    assert "dev split" in notes["sparse_auto"] and "test split" in notes["sparse_auto"]
    policy, _, notes, _ = defaults.resolve_sparse(request, prompt_tokens=4096)
    assert policy is None and "dense decoding" in notes["sparse_auto"]
    brief = GenerateRequest(prompt="q", max_new_tokens=8)
    assert defaults.resolve_sparse(brief, prompt_tokens=8192)[0] is None
