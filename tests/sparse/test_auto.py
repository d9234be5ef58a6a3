"""``sparse="auto"`` (the default): the calibrated profile's best policy, dense without a profile.

Injected: engines without a profile, with a profile naming a policy / budget / minimum context / dense
steps before the set-up, and with an older profile that has no ``sparse_auto`` entry; bad ``sparse_auto``
entries. Must happen: without a profile (or without the entry) auto decodes dense and the stats say why;
with one, auto decodes with the profile's policy and budget (a request's own kv_budget still wins), dense
below ``min_context``; with ``dense_steps`` the first steps decode dense (the tokens a dense request gets)
and the decoder is set up only after them (an answer ending within them never sets it up); a bad entry
makes the profile ignored (a warning), never a failure at generation.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from semkv.engine import Engine
from semkv.profile import AutoSparse, load_profile, profile_path, write_profile
from semkv.request import GenerateRequest

PROMPT = " ".join(f"note {i}: the lamp is {('red', 'blue', 'green')[i % 3]}." for i in range(24))


def _profile(engine: Engine, auto: dict | None) -> dict:
    defaults: dict = {"kv_budget": {"keykey": 0.3}}
    if auto is not None:
        defaults["sparse_auto"] = auto
    return {
        "version": 1,
        "model": engine.name,
        "fingerprint": engine.fingerprint,
        "target": 0.9,
        "defaults": defaults,
    }


def _reopen(engine: Engine) -> Engine:
    return Engine(engine.config, engine.hf_model, engine.tokenizer, name=engine.name)


def _gen(engine: Engine, **kw):
    return engine.generate(
        PROMPT, max_new_tokens=4, stop_at_eos=False, reuse="none", store_prompt=False, **kw
    )


def test_auto_is_the_default_and_dense_without_a_profile(make_tiny_engine):
    assert GenerateRequest(prompt="x").sparse == "auto"
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    g = _gen(engine)
    assert "sparse_policy" not in g.stats
    assert "no calibrated profile" in g.stats["sparse_auto"]
    assert g.token_ids == _gen(engine, sparse=None).token_ids


def test_auto_takes_the_profiles_policy_and_budget(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    write_profile(
        engine.config.home_path, _profile(engine, {"policy": "quest", "kv_budget": 0.25, "reason": "best"})
    )
    engine = _reopen(engine)
    g = _gen(engine)
    assert g.stats["sparse_policy"] == "quest" and g.stats["kv_budget"] == 0.25
    assert g.stats["sparse_auto"].startswith("quest @ 0.25")
    own = _gen(engine, kv_budget=0.5)
    assert own.stats["sparse_policy"] == "quest" and own.stats["kv_budget"] == 0.5
    explicit = _gen(engine, sparse="keykey")  # an explicit policy is not auto: the profile's keykey budget
    assert explicit.stats["sparse_policy"] == "keykey" and explicit.stats["kv_budget"] == 0.3
    assert "sparse_auto" not in explicit.stats


def test_auto_is_dense_below_min_context_and_for_a_dense_choice(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    write_profile(
        engine.config.home_path,
        _profile(engine, {"policy": "keykey", "kv_budget": 0.2, "min_context": 10_000}),
    )
    g = _gen(_reopen(engine))
    assert "sparse_policy" not in g.stats and "< 10000" in g.stats["sparse_auto"]
    write_profile(
        engine.config.home_path, _profile(engine, {"policy": None, "reason": "no policy reached the target"})
    )
    g = _gen(_reopen(engine))
    assert "sparse_policy" not in g.stats and "no policy reached the target" in g.stats["sparse_auto"]


def test_auto_decodes_its_dense_steps_before_setting_the_decoder_up(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    auto = {"policy": "keykey", "kv_budget": 0.2, "dense_steps": 3}
    write_profile(engine.config.home_path, _profile(engine, auto))
    engine = _reopen(engine)
    request = GenerateRequest(
        prompt=PROMPT, max_new_tokens=8, stop_at_eos=False, reuse="none", store_prompt=False
    )
    seq = engine.prefill(request)
    assert seq.sparse is not None and seq.sparse.config.dense_steps == 3
    dense = engine.prefill(replace(request, sparse=None))
    for _ in range(3):
        engine.decode_step(seq)
        engine.decode_step(dense)
        assert seq.sparse.index is None  # still dense: nothing summarised, nothing prepared
    assert seq.tokens == dense.tokens and seq.blocks.num_complete == 0
    engine.decode(seq)
    assert seq.sparse.index is seq.blocks
    stats = engine.finish(seq).stats
    assert stats["sparse_policy"] == "keykey" and stats["sparse_steps"] == 8 - 1 - 3
    short = _gen(engine)  # 4 tokens: 3 decode steps, all of them dense
    assert short.stats["sparse_policy"] == "keykey" and short.stats["sparse_steps"] == 0
    assert "prepare_s" not in short.stats
    with pytest.raises(ValueError, match="dense_steps"):
        AutoSparse("keykey", 0.1, dense_steps=-1)


def test_profile_without_auto_entry_decodes_dense(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    write_profile(engine.config.home_path, _profile(engine, None))
    g = _gen(_reopen(engine))
    assert "sparse_policy" not in g.stats and "no sparse_auto entry" in g.stats["sparse_auto"]


@pytest.mark.parametrize(
    "entry",
    [
        {"policy": "magic"},
        {"policy": "auto"},
        {"policy": "keykey", "kv_budget": 0.0},
        {"policy": "keykey", "min_context": -1},
    ],
)
def test_bad_auto_entry_ignores_the_profile(make_tiny_engine, caplog, entry):
    engine = make_tiny_engine("llama", block_size=4, disk=False)
    write_profile(engine.config.home_path, _profile(engine, entry))
    with caplog.at_level(logging.WARNING, logger="semkv.profile"):
        assert load_profile(engine.config.home_path, engine.fingerprint) is None
    assert any("malformed calibration profile" in r.message for r in caplog.records)
    assert profile_path(engine.config.home_path, engine.fingerprint).is_file()
    assert "no calibrated profile" in _gen(_reopen(engine)).stats["sparse_auto"]


def test_auto_sparse_validates():
    with pytest.raises(ValueError, match="min_context"):
        AutoSparse("keykey", 0.1, min_context=-3)
    with pytest.raises(ValueError, match="unknown sparse policy"):
        AutoSparse("nope")
    with pytest.raises(ValueError, match="'auto' or one of"):
        GenerateRequest(prompt="x", sparse="automatic")
