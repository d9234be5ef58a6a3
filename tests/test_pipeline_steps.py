"""The engine's public steps: prefill -> decode_step / decode -> store_prefill -> finish (and fork).

``generate`` is their composition, so the steps run by hand must give exactly what ``generate`` gives;
each step does only its own part (prefill stores nothing, store_prefill stores once, a fork decodes
independently); an explicitly requested reuse mode still takes an exact prefix hit that reuses more.
"""

from __future__ import annotations

import pytest
import torch

from semkv.engine import Engine
from semkv.request import GenerateRequest
from semkv.store.keys import prefix_block_keys

PROMPT = "Tell me about the harbour, the boats and the fishermen who sail at dawn every day of the week."
CHUNKS = [
    "The harbour of Varna holds forty fishing boats; most of them leave before dawn and return at noon.",
    "Mira Olsen repairs nets in the old shed by the pier. She has done so for thirty-one years.",
    "On Sundays the market by the water sells the morning catch, bread from the hill and local honey.",
]


def test_steps_compose_to_generate(make_tiny_engine):
    engine = make_tiny_engine("llama")
    options = dict(prompt=PROMPT, max_new_tokens=6, stop_at_eos=False, store_prompt=False)
    expected = engine.generate(**options)
    seq = engine.prefill(GenerateRequest(**options))
    assert seq.tokens == expected.token_ids[:1] and seq.ttft_s > 0
    streamed: list[int] = []
    new = engine.decode(seq, on_token=streamed.append)
    result = engine.finish(seq)
    assert result.token_ids == expected.token_ids == [*seq.tokens]
    assert new == expected.token_ids[1:] and streamed == expected.token_ids
    torch.testing.assert_close(result.first_logits, expected.first_logits, atol=0, rtol=0)
    assert result.stats["finish_reason"] == "length" and result.stats["path"] == expected.stats["path"]


def test_decode_in_pieces_equals_decode_at_once(make_tiny_engine):
    engine = make_tiny_engine("llama")
    request = GenerateRequest(prompt=PROMPT, max_new_tokens=7, stop_at_eos=False, store_prompt=False)
    whole = engine.prefill(request)
    engine.decode(whole)
    pieces = engine.prefill(request)
    got = engine.decode(pieces, max_steps=2) + engine.decode(pieces, max_steps=1) + engine.decode(pieces)
    assert got == whole.tokens[1:] and pieces.tokens == whole.tokens
    assert engine.decode(pieces) == [] and pieces.finished  # a finished sequence decodes nothing


def test_prefill_stores_nothing_and_store_prefill_stores_once(make_tiny_engine):
    engine = make_tiny_engine("llama")
    seq = engine.prefill(GenerateRequest(prompt=PROMPT, max_new_tokens=2))
    keys = prefix_block_keys(engine.fingerprint, engine.config.block_size, seq.layout.token_ids)
    assert len(keys) > 4 and not any(engine.store.contains(k) for k in keys)
    assert engine.store_prefill(seq) > 0
    assert all(engine.store.contains(k) for k in keys)
    assert engine.store_prefill(seq) == 0.0  # once per sequence
    skipped = engine.prefill(GenerateRequest(prompt=PROMPT + " Twice.", max_new_tokens=2, store_prompt=False))
    engine.store_prefill(skipped)
    extra = prefix_block_keys(engine.fingerprint, engine.config.block_size, skipped.layout.token_ids)
    assert not engine.store.contains(extra[-1])


def test_teacher_forcing_feeds_the_given_tokens(make_tiny_engine):
    """decode_step(feed=t) puts t in the cache in place of the sampled token: the logits equal a full
    prefill of prompt + t."""
    engine = make_tiny_engine("llama")
    request = GenerateRequest(prompt=PROMPT, max_new_tokens=3, stop_at_eos=False, store_prompt=False)
    seq = engine.prefill(request)
    forced = (seq.tokens[0] + 1) % 1000
    logits = engine.decode_step(seq, feed=forced)
    assert seq.tokens[0] == forced
    ids = seq.layout.token_ids + [forced]
    cache = engine.runtime.new_cache(len(ids))
    reference = engine.runtime.prefill(cache, ids)  # an independent oracle: the runtime on the full row set
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_fork_decodes_independently(make_tiny_engine):
    engine = make_tiny_engine("llama")
    request = GenerateRequest(prompt=PROMPT, max_new_tokens=6, stop_at_eos=False, store_prompt=False)
    base = engine.prefill(request, capture_queries=True)
    dense = engine.fork(base)
    sparse = engine.fork(base, sparse="snapkv", kv_budget=0.5)
    engine.decode(dense)
    engine.decode(sparse)
    assert base.tokens == dense.tokens[:1] and base.cache.length == len(base.layout)  # the base is untouched
    assert dense.cache.length == sparse.cache.length == len(base.layout) + 5
    assert sparse.sparse is not None and sparse.sparse.prefill is base.prefill_queries
    alone = engine.generate(**{k: getattr(request, k) for k in ("prompt", "max_new_tokens", "stop_at_eos")})
    assert dense.tokens == alone.token_ids
    with pytest.raises(ValueError, match="capture_queries=True"):
        engine.fork(engine.prefill(request), sparse="h2o")


@pytest.mark.parametrize("mode", ["blend", "share"])
def test_explicit_mode_takes_an_exact_prefix_hit(make_tiny_engine, mode):
    """A RAG prompt once prefilled in full is stored as exact prefix blocks; asked again with an explicit
    reuse mode, >= 95% of it is reused exactly and the answer is full prefill's. Blend refuses (no stored
    chunk beyond the exact prefix) and the exact prefix hit is taken, with a note saying so; share finds
    the identical stored prompt and reuses all but its last token exactly."""
    engine = make_tiny_engine("llama")
    options = dict(prompt="Where does Mira work?", chunks=CHUNKS, max_new_tokens=2, stop_at_eos=False)
    full = engine.generate(reuse="none", **options)
    got = engine.generate(reuse=mode, store_prompt=False, **options)
    assert got.stats["reused_tokens"] >= 0.95 * got.stats["prompt_tokens"]
    assert got.token_ids == full.token_ids
    if mode == "blend":
        assert got.stats["path"] == "prefix"
        assert "no stored chunk beyond the exact prefix" in got.stats["refused"]["blend"]
        assert "outdone by an exact prefix hit" in got.stats["fallback"]
    else:
        assert got.stats["path"] == "share" and got.stats["recomputed_tokens"] == 1


def test_auto_and_none_have_no_fallback_note(make_tiny_engine):
    engine = make_tiny_engine("llama")
    for reuse in ("auto", "none"):
        stats = engine.generate(prompt=PROMPT, max_new_tokens=1, reuse=reuse).stats
        assert "fallback" not in stats


def test_device_option(tmp_path, tokenizer, make_tiny_engine):
    from semkv.config import EngineConfig, StoreConfig

    engine = make_tiny_engine("llama")
    folder = tmp_path / "ckpt"
    engine.hf_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded = Engine.from_pretrained(str(folder), home=tmp_path / "h", kv_dtype="float32", device="cpu")
    assert loaded.runtime.device == torch.device("cpu") and loaded.config.device == "cpu"
    assert loaded.generate(prompt=PROMPT, max_new_tokens=2).token_ids
    with pytest.raises(ValueError, match="device 'quantum' is not a torch device"):
        EngineConfig(device="quantum", store=StoreConfig(disk=False))
    with pytest.raises(ValueError, match="device must be a str"):
        EngineConfig(device=0, store=StoreConfig(disk=False))
