"""CacheBlend (reuse="blend"): exactness at the ends of the ratio range, the trend in between,
layouts (order, repeats, one chunk, none, empty text), bad input and foreign chunks.

Tiny models get 4 layers: with check layer 1, layers 0-1 see every row fresh, so only
a model deeper than 2 layers exercises the selective part.
"""

from __future__ import annotations

import pytest
import torch

from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.evaluation.metrics import logit_kl
from semkv.request import GenerateRequest
from semkv.reuse.options import BlendConfig
from semkv.store.keys import EntryKind, chunk_key
from tests.conftest import TINY_FAMILIES, tiny_hf_model

DOCS = [
    "The lighthouse keeper of Varn Island counted ships every night and wrote their names in a blue book. "
    "Her brother repaired nets on the pier and sold smoked fish to the travellers.",
    "A recipe for plum cake: mix flour, butter and sugar, fold in sliced plums, and bake for forty minutes "
    "until the top is golden. Serve it warm with cream.",
    "The committee met on Tuesday to discuss the new railway timetable. Trains to the coast will leave "
    "every hour, and the night service is cancelled until spring.",
]
QUESTION = "Which island is mentioned, and what is baked for forty minutes?"


def _engine(make_tiny_engine, tokenizer, family: str, layers: int = 4, **kw) -> Engine:
    extra = (
        {"layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}
        if family == "gemma3_text"
        else {}
    )
    model = tiny_hf_model(family, len(tokenizer), num_hidden_layers=layers, **extra)
    return make_tiny_engine(family, hf_model=model, **kw)


def _first_logits(engine: Engine, chunks, **options) -> torch.Tensor:
    options.setdefault("store_prompt", False)
    g = engine.generate(QUESTION, chunks=chunks, max_new_tokens=1, **options)
    return g.first_logits, g.stats


def _naive_concatenation(engine: Engine, chunks) -> torch.Tensor:
    """Reference for ratio 0, built independently: stored chunk KV loaded at its positions, every other
    segment prefilled in order on top (attending to the loaded rows as they are)."""
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=chunks))
    runtime = engine.runtime
    cache = runtime.new_cache(len(layout))
    logits = None
    for seg, start, end in layout.spans():
        if not seg.token_ids:
            continue
        positions = torch.arange(start, end)
        if seg.kind == "chunk":
            entry = engine.store.get(
                chunk_key(engine.fingerprint, seg.token_ids), seg.token_ids, EntryKind.CHUNK
            )
            assert entry is not None
            runtime.load_rows(cache, entry.k, entry.v, positions, seg.token_ids)
        else:
            logits = runtime.prefill(cache, seg.token_ids, positions=positions)
    return logits


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_ratio_ends_are_exact(family, make_tiny_engine, tokenizer):
    """ratio 1.0 = full prefill logits; ratio 0 = naive concatenation of the stored caches (not full)."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    keys = engine.add_chunks(DOCS)
    assert len(keys) == 3 and all(engine.store.contains(k) for k in keys)
    full, _ = _first_logits(engine, DOCS, reuse="none")
    one, stats = _first_logits(engine, DOCS, reuse="blend", recompute_ratio=1.0)
    assert stats["path"] == "blend" and stats["chunk_hits"] == 3 and stats["reused_tokens"] == 0
    torch.testing.assert_close(one, full, atol=1e-4, rtol=0)
    zero, stats = _first_logits(engine, DOCS, reuse="blend", recompute_ratio=0.0)
    assert stats["blend_selected_tokens"] == 0
    assert stats["reused_tokens"] == stats["blend_cached_tokens"] > 0
    torch.testing.assert_close(zero, _naive_concatenation(engine, DOCS), atol=1e-4, rtol=0)
    assert (zero - full).abs().max() > 1e-3  # reuse without recompute really differs here


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_deviation_does_not_grow_with_ratio(family, make_tiny_engine, tokenizer):
    """Mean KL to full prefill over two chunk orders, for rising ratios, never rises (10% slack)."""
    engine = _engine(make_tiny_engine, tokenizer, family, layers=4)
    engine.add_chunks(DOCS)
    orders = [DOCS, DOCS[::-1]]
    fulls = [_first_logits(engine, o, reuse="none")[0] for o in orders]
    means = []
    for ratio in (0.0, 0.2, 0.5, 1.0):
        kls = [
            logit_kl(f, _first_logits(engine, o, reuse="blend", recompute_ratio=ratio)[0])
            for o, f in zip(orders, fulls, strict=True)
        ]
        means.append(sum(kls) / len(kls))
    assert means[-1] < 1e-6 < means[0]
    for lower, higher in zip(means, means[1:], strict=False):
        assert higher <= lower * 1.1 + 1e-7, means


def test_layouts_order_repeat_one_none_empty(make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, "llama")
    engine.add_chunks(DOCS)
    for chunks in ([DOCS[2], DOCS[0], DOCS[1]], [DOCS[0], DOCS[0]], [DOCS[1]], ["", DOCS[1]]):
        full, _ = _first_logits(engine, chunks, reuse="none")
        one, stats = _first_logits(engine, chunks, reuse="blend", recompute_ratio=1.0)
        assert stats["path"] == "blend" and stats["chunk_hits"] == sum(bool(c) for c in chunks)
        torch.testing.assert_close(one, full, atol=1e-4, rtol=0)
        zero, _ = _first_logits(engine, chunks, reuse="blend", recompute_ratio=0.0)
        torch.testing.assert_close(zero, _naive_concatenation(engine, chunks), atol=1e-4, rtol=0)
    # no chunks: blend is refused and the request is prefilled in full
    _, stats = _first_logits(engine, [], reuse="blend")
    assert stats["path"] == "full" and "blend" in stats["refused"]


def test_auto_prefix_hit_and_on_the_fly_chunks(make_tiny_engine, tokenizer):
    """auto picks blend only with stored chunks; an explicit blend computes and stores missing chunks;
    a prefix hit on the first chunk is loaded as exact prefix reuse."""
    engine = _engine(make_tiny_engine, tokenizer, "qwen2")
    _, stats = _first_logits(engine, DOCS[:2], reuse="auto")
    assert stats["path"] != "blend"
    _, stats = _first_logits(engine, DOCS[:2], reuse="blend", store_prompt=True)
    assert stats["path"] == "blend" and stats["chunk_hits"] == 0 and stats["chunk_misses"] == 2
    assert all(engine.store.contains(k) for k in engine.add_chunks(DOCS[:2]))  # stored after the first token
    _, stats = _first_logits(engine, DOCS[1::-1], reuse="auto")  # another order: no prefix hit past A
    assert stats["path"] == "blend" and stats["chunk_hits"] == 2
    # a full prefill of [A, B] stores its prefix blocks; [A, C] then reuses A exactly as a prefix
    engine.add_chunks(DOCS)
    _first_logits(engine, [DOCS[0], DOCS[1]], reuse="none", store_prompt=True)
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=[DOCS[0], DOCS[2]]))
    end_of_a = layout.chunk_spans()[0][2]
    full, _ = _first_logits(engine, [DOCS[0], DOCS[2]], reuse="none")
    one, stats = _first_logits(engine, [DOCS[0], DOCS[2]], reuse="blend", recompute_ratio=1.0)
    assert stats["prefix_tokens"] >= end_of_a - engine.config.block_size
    assert stats["chunk_hits"] == 1  # only C is loaded as a chunk
    torch.testing.assert_close(one, full, atol=1e-4, rtol=0)


def test_bad_input(make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=2)
    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ValueError, match="recompute_ratio"):
            engine.generate(QUESTION, chunks=DOCS, reuse="blend", recompute_ratio=bad)
        with pytest.raises(ValueError, match="recompute_ratio"):
            BlendConfig(recompute_ratio=bad)
    with pytest.raises(ValueError):
        BlendConfig(check_layer=0)
    with pytest.raises(ValueError):
        GenerateRequest(prompt="x", blend={"deviation_on": "q"})
    with pytest.raises(ValueError):
        engine.add_chunks("one string")
    with pytest.raises(ValueError, match="empty"):
        engine.add_chunks([DOCS[0], ""])
    # longer than the context (2048): a clear error before any work
    long_text = "word " * 2100
    puts = engine.store.stats.puts
    with pytest.raises(ValueError, match="context"):
        engine.add_chunks([DOCS[0], long_text])
    assert engine.store.stats.puts == puts  # nothing computed or stored
    with pytest.raises(ValueError, match="context"):
        engine.generate(QUESTION, chunks=[long_text[: len(long_text) // 2]] * 2, reuse="blend")


def test_foreign_chunks_are_misses(tmp_path, tokenizer):
    """Chunks stored by another model, or the same model at another KV dtype, share the disk tier but
    are never reused: recomputed in place (= that engine's full prefill) and stored under its own key."""

    def engine(seed: int, kv_dtype: str) -> Engine:
        config = EngineConfig(
            model="llama", home=tmp_path, kv_dtype=kv_dtype, block_size=4, store=StoreConfig()
        )
        model = tiny_hf_model("llama", len(tokenizer), seed=seed, num_hidden_layers=4)
        return Engine(config, model, tokenizer, name=f"tiny-{seed}-{kv_dtype}")

    owner = engine(0, "float32")
    owner.add_chunks(DOCS[:2])
    for other in (engine(1, "float32"), engine(0, "float16")):
        assert other.fingerprint != owner.fingerprint
        full, _ = _first_logits(other, DOCS[:2], reuse="none")
        blended, stats = _first_logits(other, DOCS[:2], reuse="blend", recompute_ratio=0.0)
        assert stats["chunk_hits"] == 0 and stats["chunk_misses"] == 2 and stats["reused_tokens"] == 0
        torch.testing.assert_close(
            blended, full, atol=1e-3 if other.config.kv_dtype == "float16" else 1e-4, rtol=0
        )
        _, stats = _first_logits(other, DOCS[:2], reuse="auto")
        assert stats["path"] != "blend"  # store_prompt=False: nothing was stored for it


@pytest.mark.real_model
def test_smollm2_blend(make_smol_engine):
    engine = make_smol_engine(kv_dtype="float32")
    engine.add_chunks(DOCS)
    full, _ = _first_logits(engine, DOCS, reuse="none")
    one, _ = _first_logits(engine, DOCS, reuse="blend", recompute_ratio=1.0)
    torch.testing.assert_close(one, full, atol=1e-4, rtol=0)
    zero, _ = _first_logits(engine, DOCS, reuse="blend", recompute_ratio=0.0)
    torch.testing.assert_close(zero, _naive_concatenation(engine, DOCS), atol=1e-4, rtol=0)
    half, stats = _first_logits(engine, DOCS, reuse="blend", recompute_ratio=0.3)
    assert 0 < stats["blend_selected_tokens"] < stats["blend_cached_tokens"]
    assert logit_kl(full, half) <= logit_kl(full, zero)
