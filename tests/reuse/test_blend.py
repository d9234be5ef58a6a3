"""CacheBlend (reuse="blend"): exactness at the ends of the ratio range, the trend in between,
layouts (order, repeats, one chunk, none, empty text), bad input and foreign chunks.

Tiny models get 4 layers: with check layer 1, layers 0-1 see every row fresh, so only
a model deeper than 2 layers exercises the selective part.
"""

from __future__ import annotations

import math

import pytest
import torch

from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.evaluation.metrics import logit_kl
from semkv.prompt import Segment, separator_ids
from semkv.request import GenerateRequest
from semkv.reuse.options import BlendConfig
from semkv.reuse.selection.registry import make_selector
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


def _naive_concatenation(engine: Engine, chunks, separators: bool = True) -> torch.Tensor:
    """Reference for ratio 0, built independently: stored chunk KV (each chunk stored with the separator
    after it, the default) loaded at its positions, every other segment prefilled in order on top
    (attending to the loaded rows as they are). ``separators``: the stored separator rows are loaded too
    (False: they are prefilled like the question, as selectors that rank by KV deviation do)."""
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=chunks))
    runtime = engine.runtime
    cache = runtime.new_cache(len(layout))
    separator = separator_ids(engine.tokenizer)
    stored = len(separator) if separators else 0
    logits = None
    loaded_separator = False  # the separator after a chunk came with the chunk's entry
    for seg, start, end in layout.spans():
        if not seg.token_ids or (seg.kind == "separator" and loaded_separator):
            loaded_separator = False
            continue
        loaded_separator = False
        if seg.kind == "chunk":
            ids = [*seg.token_ids, *separator]
            entry = engine.store.get(chunk_key(engine.fingerprint, ids), ids, EntryKind.CHUNK)
            assert entry is not None
            rows = len(ids) - len(separator) + stored
            k, v = entry.k[:, :, :rows], entry.v[:, :, :rows]
            runtime.load_rows(cache, k, v, torch.arange(start, start + rows), ids[:rows])
            loaded_separator = separators
        else:
            logits = runtime.prefill(cache, seg.token_ids, positions=torch.arange(start, end))
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
            logit_kl(f, _first_logits(engine, o, reuse="blend", blend=BlendConfig(ratio, "deviation"))[0])
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


def test_a_blends_exact_prefix_comes_from_the_page_pool(make_tiny_engine, tokenizer):
    """Injected: a full prefill of [A, B] keeps its blocks in the page pool and the store; the store's
    copy is then lost. Must happen: a blend of [A, C] loads its exact prefix (A) from the pool's pages,
    with the same first-token logits as loading it from the store, and after its first token the blend's
    exact rows are kept as pages for the next request."""
    engine = _engine(make_tiny_engine, tokenizer, "llama")
    engine.add_chunks(DOCS)
    _first_logits(engine, [DOCS[0], DOCS[1]], reuse="none", store_prompt=True)
    from_pool, pooled = _first_logits(engine, [DOCS[0], DOCS[2]], reuse="blend")
    assert pooled["prefix_tokens"] > 0 and pooled["pooled_blocks"] * 4 >= pooled["prefix_tokens"]
    engine.drop_page_pool()
    from_store, stored = _first_logits(engine, [DOCS[0], DOCS[2]], reuse="blend")
    assert stored["pooled_blocks"] == 0 and stored["prefix_tokens"] == pooled["prefix_tokens"]
    assert torch.equal(from_pool, from_store)
    _first_logits(engine, [DOCS[0], DOCS[2]], reuse="blend", store_prompt=True)  # keeps its exact rows
    _, again = _first_logits(engine, [DOCS[0], DOCS[2]], reuse="blend")
    assert again["pooled_blocks"] > 0


def test_bad_input(make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=2)
    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ValueError, match="recompute_ratio"):
            engine.generate(QUESTION, chunks=DOCS, reuse="blend", recompute_ratio=bad)
        with pytest.raises(ValueError, match="recompute_ratio"):
            BlendConfig(recompute_ratio=bad)
    with pytest.raises(ValueError, match=r"check_layer must be in \[0, 1024\]"):
        BlendConfig(check_layer=-1)
    with pytest.raises(ValueError, match="check_layer 0 cannot rank by KV deviation"):
        BlendConfig(selector="deviation", check_layer=0)
    with pytest.raises(ValueError, match="on must be one of"):
        GenerateRequest(prompt="x", blend={"selector": {"name": "deviation", "on": "q"}})
    with pytest.raises(ValueError, match="sink must be one of"):
        BlendConfig(sink="eos")
    with pytest.raises(ValueError, match="not one string"):
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
            model="llama",
            home=tmp_path,
            kv_dtype=kv_dtype,
            block_size=4,
            store=StoreConfig(),
            compute_dtype="float32",
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


# -- blend options: check layer, deviation's K / V / K+V, gradual, sink ------------------------------------------------
def _blend_seq(engine: Engine, chunks, **blend):
    request = GenerateRequest(
        prompt=QUESTION, chunks=chunks, max_new_tokens=1, reuse="blend", store_prompt=False, blend=blend
    )
    seq = engine.prefill(request)
    assert seq.outcome.path == "blend" and seq.outcome.info["chunk_hits"] == len(chunks)
    return seq


def _full_seq(engine: Engine, chunks):
    return engine.prefill(
        GenerateRequest(prompt=QUESTION, chunks=chunks, max_new_tokens=1, reuse="none", store_prompt=False)
    )


def _stored_spans(engine: Engine, layout, separators: bool = True) -> list[tuple[int, int, list[int]]]:
    """(first row, end row, stored token ids) of every chunk of ``layout``, with the separator after it
    (``separators``: chunks stored with their separator, the default)."""
    separator = separator_ids(engine.tokenizer) if separators else []
    return [
        (start, end + len(separator), [*seg.token_ids, *separator])
        for seg, start, end in layout.chunk_spans()
        if seg.token_ids
    ]


def _laid_out(engine: Engine, layout, separators: bool = True) -> list[tuple[Segment, int, int, object]]:
    """The pieces a blend lays ``layout`` out in: (segment, start, end, stored chunk entry or None). A stored
    chunk's piece covers its separator too (``separators``: chunks stored with it, the default), so the
    separator's own segment is left out."""
    stored = {start: (end, ids) for start, end, ids in _stored_spans(engine, layout, separators)}
    pieces, row = [], 0
    for seg, start, end in layout.spans():
        if start < row or start == end:
            continue  # a separator loaded with its chunk
        entry = None
        if start in stored:
            end, ids = stored[start]
            entry = engine.store.get(chunk_key(engine.fingerprint, ids), ids, EntryKind.CHUNK)
            assert entry is not None
        pieces.append((seg, start, end, entry))
        row = end
    return pieces


def _reused_spans(engine: Engine, layout, selector: object = "query") -> list[tuple[int, int, list[int]]]:
    """:func:`_stored_spans` cut to the rows a blend ranked by ``selector`` reuses: a chunk's, and its stored
    separator's unless the selector recomputes separators (the ones that rank by KV deviation)."""
    spans = _stored_spans(engine, layout)
    if make_selector(selector).recomputes_separators:
        cut = len(separator_ids(engine.tokenizer))
        spans = [(start, end - cut, ids) for start, end, ids in spans]
    return spans


def _chunk_rows(engine: Engine, layout, selector: object = "query") -> list[tuple[int, int, object]]:
    """(row, row within its stored chunk, stored chunk entry) of every row of ``layout`` a blend ranked by
    ``selector`` reuses: the chunks' rows and (see :func:`_reused_spans`) their separators'."""
    rows = []
    for start, end, ids in _reused_spans(engine, layout, selector):
        entry = engine.store.get(chunk_key(engine.fingerprint, ids), ids, EntryKind.CHUNK)
        rows += [(start + i, i, entry) for i in range(end - start)]
    return rows


def _rows_holding_reused_kv(seq, rows, layer: int) -> set[int]:
    """Rows whose KV at ``layer`` is still exactly the stored chunk's (never recomputed there)."""
    return {
        row
        for row, i, entry in rows
        if torch.equal(seq.cache.k_pre[layer][:, row], entry.k[layer][:, i])
        and torch.equal(seq.cache.v[layer][:, row], entry.v[layer][:, i])
    }


@pytest.mark.parametrize("check_layer", [1, 2, 3])
def test_check_layer_recomputes_every_row_up_to_it(make_tiny_engine, tokenizer, check_layer):
    """Layers up to the check layer see every row fresh (their KV equals full prefill's); after it only
    the selected rows are recomputed, the others keep the stored chunk KV. At the last layer (3 of 4)
    the check changes nothing: the blend is full prefill."""
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=4)
    engine.add_chunks(DOCS)
    ratio = 0.3
    blend, full = (
        _blend_seq(engine, DOCS, recompute_ratio=ratio, selector="deviation", check_layer=check_layer),
        _full_seq(engine, DOCS),
    )
    assert blend.outcome.info["check_layer"] == check_layer
    n = len(blend.layout)
    for layer in range(check_layer + 1):
        torch.testing.assert_close(
            blend.cache.k_pre[layer][:, :n], full.cache.k_pre[layer][:, :n], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(blend.cache.v[layer][:, :n], full.cache.v[layer][:, :n], atol=1e-5, rtol=0)
    rows = _chunk_rows(engine, blend.layout, "deviation")
    selected = math.ceil(ratio * len(rows))
    assert blend.outcome.info["blend_selected_tokens"] == selected
    for layer in range(check_layer + 1, engine.num_layers):
        assert len(_rows_holding_reused_kv(blend, rows, layer)) == len(rows) - selected
    if check_layer == engine.num_layers - 1:
        torch.testing.assert_close(blend.first_logits, full.first_logits, atol=1e-4, rtol=0)
    else:
        assert (blend.first_logits - full.first_logits).abs().max() > 1e-3


def test_deviation_on_ranks_rows_by_keys_values_or_both(make_tiny_engine, tokenizer):
    """At the check layer the selected cached rows are the ones whose fresh KV (= full prefill's there)
    deviates most from the stored chunk KV, measured on K, V or both."""
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=4)
    engine.add_chunks(DOCS)
    full = _full_seq(engine, DOCS)
    chosen = {}
    for on in ("k", "v", "kv"):
        selector = {"name": "deviation", "on": on}
        blend = _blend_seq(engine, DOCS, recompute_ratio=0.2, selector=selector, check_layer=1)
        rows = _chunk_rows(engine, blend.layout, "deviation")
        dk = {r: float((full.cache.k_pre[1][:, r] - e.k[1][:, i].float()).pow(2).sum()) for r, i, e in rows}
        dv = {r: float((full.cache.v[1][:, r] - e.v[1][:, i].float()).pow(2).sum()) for r, i, e in rows}
        deviation = {r: (dk[r] if on == "k" else dv[r] if on == "v" else dk[r] + dv[r]) ** 0.5 for r in dk}
        picked = set(blend.outcome.info["recomputed_rows"]) & set(deviation)
        assert len(picked) == math.ceil(0.2 * len(rows))
        left = set(deviation) - picked
        assert min(deviation[r] for r in picked) >= max(deviation[r] for r in left) - 1e-4, on
        chosen[on] = picked
    assert chosen["k"] != chosen["v"]  # the three measures really rank differently here


@pytest.mark.parametrize("gradual", [False, True])
def test_gradual_filtering_narrows_over_three_layers(make_tiny_engine, tokenizer, gradual):
    """gradual=True keeps 2r of the cached rows after the check layer, 1.5r after the next, r from the
    one after; without it, r from the check layer on (counted as rows recomputed per layer)."""
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=6)
    engine.add_chunks(DOCS)
    ratio = 0.2
    blend = _blend_seq(
        engine, DOCS, recompute_ratio=ratio, selector="deviation", check_layer=1, gradual=gradual
    )
    rows = _chunk_rows(engine, blend.layout, "deviation")
    recomputed = [len(rows) - len(_rows_holding_reused_kv(blend, rows, layer)) for layer in range(2, 6)]
    fractions = (2 * ratio, 1.5 * ratio, ratio, ratio) if gradual else (ratio,) * 4
    assert recomputed == [math.ceil(f * len(rows)) for f in fractions]
    assert blend.outcome.info["blend_selected_tokens"] == math.ceil(ratio * len(rows))


@pytest.mark.parametrize("sink", ["bos", "template", "none"])
def test_sink_mode_decides_what_a_chunk_is_computed_after(make_tiny_engine, tokenizer, sink):
    """A chunk's stored KV is its rows of a prefill after the sink tokens (BOS, the chat template's
    prefix, or nothing), the sink's own rows dropped; a chunk stored with another sink is a miss for a
    request with this one, recomputed and stored again with its sink."""
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=2)
    expected_sink = {
        "none": [],
        "bos": [tokenizer.bos_token_id],
        "template": engine.layout(GenerateRequest(prompt="x")).segments[0].token_ids,
    }[sink]
    assert sink == "none" or expected_sink
    (key,) = engine.add_chunks(DOCS[:1], BlendConfig(sink=sink))
    ids = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"] + separator_ids(tokenizer)
    entry = engine.store.get(key, ids, EntryKind.CHUNK)
    assert entry.meta["sink_tokens"] == len(expected_sink)
    cache = engine.runtime.new_cache(len(expected_sink) + len(ids))
    engine.runtime.prefill(cache, expected_sink + ids)
    k, v = cache.export(len(expected_sink), len(expected_sink) + len(ids))
    torch.testing.assert_close(entry.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(entry.v, v, atol=1e-5, rtol=0)

    other = "none" if sink != "none" else "bos"
    _, stats = _first_logits(engine, DOCS[:1], reuse="blend", blend={"sink": other}, store_prompt=True)
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (0, 1)
    assert engine.store.get(key, ids, EntryKind.CHUNK).meta["sink_tokens"] == (1 if other == "bos" else 0)
    puts = engine.store.stats.puts
    assert engine.add_chunks(DOCS[:1], BlendConfig(sink=other)) == [key]
    assert engine.store.stats.puts == puts  # found under its new sink: not computed again
