"""Engine pipeline: prefix reuse is exact and persists; bad input fails clearly and stores nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from semkv.config import StoreConfig, default_home
from semkv.engine import Engine
from semkv.models.loader import resolve_checkpoint
from semkv.request import GenerateRequest
from tests.conftest import TINY_FAMILIES, require_embedded

DOC = " ".join(f"Sentence number {i} talks about topic {i % 7}." for i in range(40))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_prefix_reuse_gives_identical_output(make_tiny_engine, family):
    engine = make_tiny_engine(family, kv_dtype="float32", block_size=4)
    full = engine.generate(
        prompt=DOC + " First question?", max_new_tokens=12, reuse="none", stop_at_eos=False
    )
    assert full.stats["path"] == "full" and full.stats["reused_tokens"] == 0
    again = engine.generate(
        prompt=DOC + " Second question?", max_new_tokens=12, reuse="auto", stop_at_eos=False
    )
    assert again.stats["path"] == "prefix" and again.stats["reused_tokens"] > 0
    baseline = engine.generate(
        prompt=DOC + " Second question?",
        max_new_tokens=12,
        reuse="none",
        stop_at_eos=False,
        store_prompt=False,
    )
    assert again.token_ids == baseline.token_ids
    assert (again.first_logits - baseline.first_logits).abs().max() < 1e-4


def test_fully_cached_prompt_still_computes_last_token(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=1)
    first = engine.generate(prompt=DOC, max_new_tokens=4, stop_at_eos=False)
    second = engine.generate(prompt=DOC, max_new_tokens=4, stop_at_eos=False)
    assert second.stats["reused_tokens"] == second.stats["prompt_tokens"] - 1
    assert second.stats["recomputed_tokens"] == 1
    assert second.token_ids == first.token_ids


def test_fp16_kv_reuse_is_bit_identical(make_tiny_engine):
    """With KV at rest in fp16, live attention also sees fp16-rounded KV: the reused rows hold exactly
    (bit for bit) the keys and values a recompute gives, so the tokens are the same; the logits differ
    only by the float rounding of a different attention kernel for the uncached suffix."""
    engine = make_tiny_engine("qwen2", kv_dtype="float16", block_size=4)
    engine.generate(prompt=DOC + " A?", max_new_tokens=2)
    options = dict(prompt=DOC + " B?", max_new_tokens=8, stop_at_eos=False)
    reused = engine.prefill(GenerateRequest(**options))
    fresh = engine.prefill(GenerateRequest(**options, reuse="none", store_prompt=False))
    assert reused.outcome.path == "prefix" and fresh.outcome.path == "full"
    n = reused.outcome.reused_tokens
    assert n > 0.9 * len(reused.layout)  # all but the differing question and the template suffix
    for layer in range(engine.num_layers):
        for buffers in ("k_pre", "k_rot", "v"):
            got, want = getattr(reused.cache, buffers)[layer], getattr(fresh.cache, buffers)[layer]
            assert torch.equal(got[:, :n], want[:, :n]), (layer, buffers)
    assert reused.cache.k_pre[0].dtype == torch.float16
    torch.testing.assert_close(reused.first_logits, fresh.first_logits, atol=1e-5, rtol=0)
    engine.decode(reused)
    engine.decode(fresh)
    assert reused.tokens == fresh.tokens


@pytest.mark.parametrize(
    "options, message",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "hi", "reuse": "bogus"}, "unknown reuse mode"),
        ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "hi", "max_new_tokens": 10**9}, "max_new_tokens"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": None}, "exactly one"),
        ({"prompt": "word " * 3000}, "exceeds the model's context"),
        ({"prompt": "hi", "use_chat_template": "no"}, "use_chat_template"),
        ({"messages": [{"role": "user", "content": "hi"}], "use_chat_template": False}, "chat template"),
    ],
)
def test_bad_input_is_a_clear_error_and_stores_nothing(make_tiny_engine, options, message):
    engine = make_tiny_engine("llama")
    with pytest.raises(ValueError, match=message):
        engine.generate(**options)
    assert engine.store.stats.puts == 0
    assert list(engine.store.tier("disk").keys()) == []


def test_plain_text_prompt_skips_the_chat_template(make_tiny_engine):
    """use_chat_template=False lays the prompt out as plain text: fewer tokens, no template ids."""
    engine = make_tiny_engine("llama")
    chat = engine.generate(prompt="What is the pass key?", max_new_tokens=2)
    plain = engine.generate(prompt="What is the pass key?", max_new_tokens=2, use_chat_template=False)
    expected = engine.tokenizer("What is the pass key?", add_special_tokens=True)["input_ids"]
    assert plain.stats["prompt_tokens"] == len(expected)
    assert chat.stats["prompt_tokens"] > plain.stats["prompt_tokens"]


def test_missing_and_unsupported_model_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an embedded model"):
        Engine.from_pretrained(str(tmp_path / "nope"), home=tmp_path)
    folder = tmp_path / "weird"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'.*llama"):
        Engine.from_pretrained(str(folder), home=tmp_path)


@pytest.mark.real_model
def test_prefix_reuse_persists_across_processes(tmp_path, make_smol_engine):
    """A second process reuses, by prefix reuse, the blocks the first wrote to disk, and answers
    identically (both compute in float32: entries of another compute dtype are a miss)."""
    home = tmp_path / "shared-home"
    engine = make_smol_engine(kv_dtype="float16", home=home)
    question = DOC + "\n\nWhich topic does sentence 3 talk about?"
    first = engine.generate(prompt=question, max_new_tokens=8)
    script = textwrap.dedent(
        f"""
        import json, sys
        from semkv.config import EngineConfig, default_home
        from semkv.engine import Engine
        from semkv.models.loader import load_model
        m = load_model("smollm2-135m", default_home())
        config = EngineConfig(home={str(home)!r}, kv_dtype="float16", compute_dtype="float32")
        e = Engine(config, m.hf_model, m.tokenizer)
        g = e.generate(prompt={question!r}, max_new_tokens=8, reuse="prefix")
        print(json.dumps({{"path": g.stats["path"], "reused": g.stats["reused_tokens"], "ids": g.token_ids}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert result["path"] == "prefix"
    n = first.stats["prompt_tokens"]
    assert result["reused"] == min(n // 16 * 16, n - 1)  # every full block the first process stored
    assert result["ids"] == first.token_ids


@pytest.mark.real_model
def test_from_pretrained_with_defaults_and_with_models_dir(tmp_path, monkeypatch):
    """``Engine.from_pretrained()`` with no argument: SmolLM2, KV float16, blocks of 16, CPU, the home from
    $SEMKV_HOME with a disk store under it (the converted model is linked in, not converted again);
    ``models_dir=`` reads the converted model from another folder and writes none into ``home``."""
    require_embedded("smollm2-135m")
    converted = resolve_checkpoint("smollm2-135m", default_home())
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "smollm2-135m").symlink_to(converted)
    monkeypatch.setenv("SEMKV_HOME", str(home))
    engine = Engine.from_pretrained()
    config = engine.config
    assert (engine.name, config.kv_dtype, config.block_size, config.device) == (
        "smollm2-135m",
        "float16",
        16,
        "cpu",
    )
    assert config.home_path == home and engine.runtime.kv_dtype == torch.float16
    assert (
        engine.store.tier("disk").root == home / "store" and engine.store.memory.budget_bytes == 2 * 1024**3
    )
    answer = engine.generate(prompt="What is the capital of France?", max_new_tokens=12)
    assert "Paris" in answer.text and answer.stats["prompt_tokens"] > 20  # the chat template is applied
    assert any((home / "store").rglob("*.skv"))

    other = tmp_path / "other-home"
    shared = Engine.from_pretrained(home=other, models_dir=home / "models", store=StoreConfig(disk=False))
    assert shared.fingerprint == engine.fingerprint and not (other / "models").exists()
    assert shared.generate(prompt="What is the capital of France?", max_new_tokens=12).text == answer.text
