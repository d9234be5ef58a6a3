"""Blend row selectors: every selector through the same checks on every tiny family, then what each
one promises on its own (deviation ranks by deviation, query by the probe's attention, chunk-start
takes chunk starts, random is seeded), APE-style attention scaling, and bad selector options.

Tiny models get 4 layers (check layer 1): layers 2-3 run only the selected rows.
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from semkv.engine import Engine
from semkv.models.runtime import attention
from semkv.request import GenerateRequest
from semkv.reuse.options import BlendConfig
from semkv.reuse.selection.base import RowInfo, scaled_attention
from semkv.reuse.selection.registry import SELECTORS, make_selector
from semkv.reuse.selective import QueryProbe, query_attention, question_attention
from semkv.store.keys import EntryKind, chunk_key
from tests.conftest import TINY_FAMILIES
from tests.reuse.test_blend import (
    DOCS,
    QUESTION,
    _engine,
    _first_logits,
    _laid_out,
    _naive_concatenation,
    _reused_spans,
)

# every registered selector, with a setting that differs from its default where it has one
SELECTOR_SPECS = [
    "deviation",
    {"name": "deviation", "on": "v"},
    "query",
    {"name": "query", "layers": [1, 2, 3]},
    "query+deviation",
    {"name": "chunk-start", "k": 4},
    "random",
]
SPEC_IDS = [
    "deviation",
    "deviation-v",
    "query",
    "query-layers",
    "query+deviation",
    "chunk-start",
    "random",
]


def test_every_registered_selector_is_in_the_matrix():
    assert {make_selector(s).name for s in SELECTOR_SPECS} == set(SELECTORS)


def _layout_rows(
    engine: Engine, chunks: list[str], selector: object = "query"
) -> tuple[set[int], set[int], list[tuple[int, int]]]:
    """(chunk rows, other rows, chunk spans) of the request's layout as a blend ranked by ``selector`` sees
    them; a chunk's rows and span include the separator stored with it unless the selector recomputes it."""
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=chunks))
    spans = [(s, e) for s, e, _ in _reused_spans(engine, layout, selector)]
    chunk_rows = {r for s, e in spans for r in range(s, e)}
    return chunk_rows, set(range(len(layout))) - chunk_rows, spans


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("spec", SELECTOR_SPECS, ids=SPEC_IDS)
def test_selector_matrix(spec, family, make_tiny_engine, tokenizer):
    """Ratio 1 = full prefill and ratio 0 = the naive concatenation, whatever the selector; in between
    every uncached row is recomputed, only chunk rows are selected, the budget is never exceeded and
    the same request selects the same rows."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS)
    full, _ = _first_logits(engine, DOCS, reuse="none")
    one, stats = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(1.0, spec))
    assert stats["reused_tokens"] == 0 and stats["selector"]["name"] == make_selector(spec).name
    torch.testing.assert_close(one, full, atol=1e-4, rtol=0)
    zero, stats = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.0, spec))
    assert stats["blend_selected_tokens"] == 0
    naive = _naive_concatenation(engine, DOCS, not make_selector(spec).recomputes_separators)
    torch.testing.assert_close(zero, naive, atol=1e-4, rtol=0)

    chunk_rows, other_rows, _ = _layout_rows(engine, DOCS, spec)
    for ratio in (0.1, 0.3):
        config = BlendConfig(ratio, spec)
        logits, stats = _first_logits(engine, DOCS, reuse="blend", blend=config)
        chosen = set(stats["recomputed_rows"])
        uncached = {r for r in other_rows if r >= stats["prefix_tokens"]}
        assert uncached <= chosen, "an uncached row was not recomputed"
        selected = chosen - uncached
        assert selected <= chunk_rows and len(selected) == stats["blend_selected_tokens"]
        budget = math.ceil(ratio * stats["blend_cached_tokens"])
        assert 0 < len(selected) <= budget
        if config.selector.name != "chunk-start":  # chunk-start may leave budget unspent
            assert len(selected) == budget
        again, stats_again = _first_logits(engine, DOCS, reuse="blend", blend=config)
        assert stats_again["recomputed_rows"] == stats["recomputed_rows"]
        torch.testing.assert_close(again, logits, atol=0, rtol=0)


def test_selectors_choose_differently(make_tiny_engine, tokenizer):
    """The selector really decides: deviation, query, chunk-start and random pick different rows."""
    engine = _engine(make_tiny_engine, tokenizer, "llama")
    engine.add_chunks(DOCS)
    picks = {}
    for name in ("deviation", "query", "chunk-start", "random"):
        _, stats = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.2, name))
        picks[name] = frozenset(stats["recomputed_rows"])
    assert len(set(picks.values())) == 4, picks


def test_deviation_keeps_the_most_deviating_rows(make_tiny_engine, tokenizer):
    """At the check layer the kept cached rows are exactly the top rows by K deviation."""
    engine = _engine(make_tiny_engine, tokenizer, "llama")
    engine.add_chunks(DOCS)
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=DOCS))
    deviations = _reference_deviation(engine, layout)
    _, stats = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.3, "deviation"))
    chunk_rows, _, _ = _layout_rows(engine, DOCS, "deviation")
    selected = sorted(set(stats["recomputed_rows"]) & chunk_rows)
    budget = len(selected)
    expected = sorted(sorted(deviations, key=deviations.get, reverse=True)[:budget])
    assert selected == expected


def _reference_deviation(engine: Engine, layout) -> dict[int, float]:
    """K deviation at layer 1 of every chunk row (deviation recomputes the separators), from a full prefill
    (layer 1's fresh keys) against the stored chunk keys: the check layer sees exactly these (layers 0 and
    1 run every row)."""
    runtime = engine.runtime
    cache = runtime.new_cache(len(layout))
    runtime.prefill(cache, layout.token_ids)
    out = {}
    for start, end, ids in _reused_spans(engine, layout, "deviation"):
        entry = engine.store.get(chunk_key(engine.fingerprint, ids), ids, EntryKind.CHUNK)
        fresh = cache.k_pre[1][:, start:end].float()
        stored = entry.k[1, :, : end - start].float()
        for i, dev in enumerate((fresh - stored).pow(2).sum(dim=(0, 2)).sqrt().tolist()):
            out[start + i] = dev
    return out


def _manual_probe(engine: Engine, layers: tuple[int, ...], separators: bool = True):
    """The blend's rows laid out by hand (chunk KV loaded with its separator's, the rest blank) and a
    QueryProbe run over them, capturing every layer's queries. Returns (probe, captured queries, cache,
    forced, query)."""
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=DOCS))
    runtime = engine.runtime
    cache = runtime.new_cache(len(layout))
    forced, query = [], []
    for seg, start, end, entry in _laid_out(engine, layout, separators):
        if entry is not None:
            ids = layout.token_ids[start:end]
            runtime.load_rows(cache, entry.k, entry.v, torch.arange(start, end), ids)
        else:
            cache.append_rows(torch.arange(start, end), seg.token_ids)
            for layer in range(runtime.num_layers):
                zeros = torch.zeros(cache.num_kv_heads, end - start, cache.head_dim)
                cache.write(layer, slice(start, end), zeros, zeros, zeros)
        forced += [entry is None] * (end - start)
        query += [seg.kind in ("body", "suffix")] * (end - start)
    forced, query = torch.tensor(forced), torch.tensor(query)
    rows = RowInfo(forced, query, torch.full((len(forced),), -1))
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    cache.query_observer = lambda layer, queries: captured.__setitem__(
        layer, (queries.rotated(), queries.positions)
    )
    probe = QueryProbe(rows, layers)
    runtime.forward_rows(cache, 0, probe)
    cache.query_observer = None
    return probe, captured, cache, forced, query


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_query_probe_records_the_question_attention(family, make_tiny_engine, tokenizer):
    """The probe's score of each row is the attention the question rows pay it at the probe layers,
    summed over heads and question rows, recomputed here from the captured queries and the keys the
    probe attended to (sliding-window layers are skipped)."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS)
    layers = (1, 2, 3)
    probe, captured, cache, forced, query = _manual_probe(engine, layers)
    expected = torch.zeros(forced.numel())
    asking = query[forced]  # the question among the forced (active) rows
    recorded = 0
    for layer in layers:
        if engine.adapter.window(layer) is not None:
            continue
        q_rot, q_pos = captured[layer]
        keys, k_pos = cache.keys(layer), cache.valid_positions()
        expected += _naive_attention_mass(
            q_rot[:, asking], keys, q_pos[asking], k_pos, engine.adapter.scaling(layer)
        )
        recorded += 1
    assert recorded == (2 if family == "gemma3_text" else 3)  # gemma: layer 2 slides
    torch.testing.assert_close(probe.scores, expected, atol=1e-5, rtol=1e-5)
    assert float(probe.scores[~forced].sum()) > 0


def _naive_attention_mass(q, k, q_pos, k_pos, scaling) -> torch.Tensor:
    nh, kvh = q.shape[0], k.shape[0]
    mass = torch.zeros(k.shape[1])
    for head in range(nh):
        keys = k[head // (nh // kvh)]
        for i in range(q.shape[1]):
            logits = (keys @ q[head, i]) * scaling
            logits[k_pos > q_pos[i]] = float("-inf")
            mass += torch.softmax(logits, dim=0)
    return mass


def test_query_attention_matches_naive():
    torch.manual_seed(0)
    q, k = torch.randn(6, 5, 8), torch.randn(2, 20, 8)
    q_pos, k_pos = torch.tensor([3, 9, 12, 18, 19]), torch.arange(20)
    torch.testing.assert_close(
        query_attention(q, k, q_pos, k_pos, 0.35), _naive_attention_mass(q, k, q_pos, k_pos, 0.35)
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_question_attention_is_the_layer_attention(dtype, tol):
    """The probe computes the question rows' attention itself (to record its weights): its output must be
    the kernel's, scattered earlier keys and the question's own causal band included."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(6, 5, 8).to(dtype),
        torch.randn(2, 40, 8).to(dtype),
        torch.randn(2, 40, 8).to(dtype),
    )
    q_pos, k_pos = torch.tensor([35, 36, 37, 38, 39]), torch.arange(40)
    out, mass = question_attention(q, k, v, q_pos, k_pos, 0.35)
    torch.testing.assert_close(
        out.float(), attention(q, k, v, q_pos, k_pos, 0.35).float(), atol=tol, rtol=tol
    )
    torch.testing.assert_close(mass, query_attention(q, k, q_pos, k_pos, 0.35))
    assert float(mass[36:].sum()) < float(mass[35]) + 10  # keys after a query get none of its mass
    torch.testing.assert_close(mass.sum(), torch.tensor(6.0 * 5))


def _blend_cache(engine: Engine, selector: dict, separators: bool = True):
    blend = BlendConfig(0.2, selector, separator_in_chunk=separators)
    request = GenerateRequest(prompt=QUESTION, chunks=DOCS, reuse="blend", blend=blend, store_prompt=False)
    seq = engine.prefill(request)
    assert seq.stats()["prefix_tokens"] == 0  # the blend's rows are the manual probe's
    return seq.cache, seq.stats()


def _rows(buffer: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rows ``mask`` [T] picks of a cache buffer [kvh, capacity, d]."""
    return buffer[:, : mask.numel()][:, mask]


def test_probe_rows_keep_the_probe_kv(make_tiny_engine, tokenizer):
    """keep_probe_rows: the forced rows other than the question keep the KV the probe wrote at every layer;
    without it (the default) they are recomputed over the refreshed chunk rows (other KV), and so is the
    question either way. The rows counted as recomputed are the same either way. Chunks stored without
    their separators, so the separators are forced rows besides the template's."""
    engine = _engine(make_tiny_engine, tokenizer, "qwen2")
    engine.add_chunks(DOCS, BlendConfig(separator_in_chunk=False))
    windows = [engine.adapter.window(layer) for layer in range(engine.num_layers)]
    layers = make_selector("query").probe_layers(windows)
    probe, _, probe_cache, forced, query = _manual_probe(engine, layers, separators=False)
    kept, kept_stats = _blend_cache(engine, {"name": "query", "keep_probe_rows": True}, separators=False)
    redone, redone_stats = _blend_cache(engine, "query", separators=False)
    settled = forced & ~query
    settled[-1] = False
    assert int(settled.sum()) > 3
    assert torch.equal(probe.settled_rows(engine.num_layers), settled)
    assert kept_stats["recomputed_rows"] == redone_stats["recomputed_rows"]
    for layer in range(engine.num_layers):
        torch.testing.assert_close(
            _rows(kept.k_pre[layer], settled), _rows(probe_cache.k_pre[layer], settled), atol=0, rtol=0
        )
        torch.testing.assert_close(
            _rows(kept.v[layer], settled), _rows(probe_cache.v[layer], settled), atol=0, rtol=0
        )
    last = engine.num_layers - 1
    assert not torch.equal(_rows(redone.k_pre[last], settled), _rows(probe_cache.k_pre[last], settled))
    assert not torch.equal(_rows(kept.k_pre[last], query), _rows(probe_cache.k_pre[last], query))


def test_probe_settles_nothing_when_it_stops_early():
    """A probe that stopped before the last layer left the forced rows blank there: none is settled."""
    forced = torch.tensor([True, False, False, True, True, True])
    query = torch.tensor([False, False, False, False, True, True])
    rows = RowInfo(forced, query, torch.full((6,), -1))
    assert QueryProbe(rows, (1, 3)).settled_rows(4).tolist() == [True, False, False, True, False, False]
    assert not QueryProbe(rows, (1, 2)).settled_rows(4).any()
    with pytest.raises(ValueError, match="forced and settled"):
        RowInfo(forced, query, torch.full((6,), -1), forced.clone())


def test_query_selector_keeps_the_probe_top_rows(make_tiny_engine, tokenizer):
    """query's cached picks are the chunk rows with the most question attention in a probe run by hand."""
    engine = _engine(make_tiny_engine, tokenizer, "qwen2")
    engine.add_chunks(DOCS)
    selector = make_selector("query")
    windows = [engine.adapter.window(layer) for layer in range(engine.num_layers)]
    probe, _, _, forced, _ = _manual_probe(engine, selector.probe_layers(windows))
    _, stats = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.2, selector))
    assert stats["prefix_tokens"] == 0  # nothing stored as a prefix: the blend's rows are the probe's
    selected = sorted(set(stats["recomputed_rows"]) - set(forced.nonzero().squeeze(1).tolist()))
    cached = (~forced).nonzero().squeeze(1)
    ranked = cached[torch.topk(probe.scores[cached], len(selected)).indices]
    assert selected == sorted(ranked.tolist())


def test_chunk_start_takes_chunk_starts(make_tiny_engine, tokenizer):
    """k = 4 with a budget to spare: exactly the first 4 tokens of every chunk; a tight budget: the
    same number of first tokens from every chunk (within one)."""
    engine = _engine(make_tiny_engine, tokenizer, "mistral")
    engine.add_chunks(DOCS)
    _, _, spans = _layout_rows(engine, DOCS)
    _, stats = _first_logits(
        engine, DOCS, reuse="blend", blend=BlendConfig(0.5, {"name": "chunk-start", "k": 4})
    )
    chosen = set(stats["recomputed_rows"])
    assert {r for s, e in spans for r in range(s, e) if r in chosen} == {
        r for s, _ in spans for r in range(s, s + 4)
    }
    _, stats = _first_logits(
        engine, DOCS, reuse="blend", blend=BlendConfig(0.02, {"name": "chunk-start", "k": 8})
    )
    chosen = set(stats["recomputed_rows"])
    per_chunk = []
    for s, e in spans:
        picked = sorted(r - s for r in range(s, e) if r in chosen)
        assert picked == list(range(len(picked)))  # a prefix of the chunk
        per_chunk.append(len(picked))
    assert max(per_chunk) - min(per_chunk) <= 1 and sum(per_chunk) == stats["blend_selected_tokens"] > 0


def test_random_is_seeded(make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, "llama")
    engine.add_chunks(DOCS)
    rows = [
        _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.2, {"name": "random", "seed": s}))[1][
            "recomputed_rows"
        ]
        for s in (1, 1, 2)
    ]
    assert rows[0] == rows[1] != rows[2]


# -- APE-style attention scaling ------------------------------------------------------------------------


def _scaled_reference(q, k, v, q_pos, k_pos, scaling, window, context, temperature, scale):
    """Per head and query: weights exp(l) for other keys, scale * exp(l / temperature) for context keys."""
    nh, tq, d = q.shape
    kvh = k.shape[0]
    out = torch.zeros(tq, nh, d)
    for head in range(nh):
        keys, values = k[head // (nh // kvh)], v[head // (nh // kvh)]
        for i in range(tq):
            logits = (keys @ q[head, i]) * scaling
            weights = torch.where(context, scale * torch.exp(logits / temperature), torch.exp(logits))
            seen = k_pos <= q_pos[i]
            if window is not None:
                seen &= q_pos[i] - k_pos < window
            weights = weights * seen
            out[i, head] = (weights / weights.sum()) @ values
    return out.reshape(tq, nh * d)


@pytest.mark.parametrize("window", [None, 6])
def test_scaled_attention(window):
    torch.manual_seed(1)
    q, k, v = torch.randn(4, 5, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    q_pos, k_pos = torch.tensor([11, 12, 13, 14, 15]), torch.arange(16)
    context = (k_pos >= 3) & (k_pos < 11)
    plain = attention(q, k, v, q_pos, k_pos, 0.3, window)
    same = scaled_attention(q, k, v, q_pos, k_pos, 0.3, window, context, 1.0, 1.0)
    torch.testing.assert_close(same, plain, atol=1e-5, rtol=1e-5)
    scaled = scaled_attention(q, k, v, q_pos, k_pos, 0.3, window, context, 0.7, 0.5)
    torch.testing.assert_close(
        scaled, _scaled_reference(q, k, v, q_pos, k_pos, 0.3, window, context, 0.7, 0.5), atol=1e-5, rtol=1e-5
    )
    assert (scaled - plain).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_scaling_in_the_blend(family, make_tiny_engine, tokenizer):
    """temperature = scale = 1 changes nothing; other values change the blend's logits (the question
    rows' attention to the chunks), for any selector."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS)
    for name in ("deviation", "chunk-start"):
        base, _ = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.3, name))
        unit = {"name": name, "temperature": 1.0, "scale": 1.0}
        same, _ = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.3, unit))
        torch.testing.assert_close(same, base, atol=0, rtol=0)
        scaled = {"name": name, "temperature": 0.8, "scale": 0.9}
        other, stats = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(0.3, scaled))
        assert (other - base).abs().max() > 1e-4
        assert stats["selector"]["temperature"] == 0.8


# -- bad input ---------------------------------------------------------------------------------------------

BAD_SELECTORS = [
    ("bogus", "selector"),
    ({"name": "bogus"}, "selector"),
    ({"k": 3}, "name"),
    (7, "selector"),
    ({"name": "chunk-start", "k": -1}, "k"),
    ({"name": "chunk-start", "k": 2.5}, "k"),
    ({"name": "deviation", "temperature": 0}, "temperature"),
    ({"name": "query", "temperature": 2.5}, "temperature"),
    ({"name": "query", "temperature": -0.5}, "temperature"),
    ({"name": "random", "scale": 0.0}, "scale"),
    ({"name": "random", "scale": 3}, "scale"),
    ({"name": "random", "scale": True}, "scale"),
    ({"name": "deviation", "on": "q"}, "on"),
    ({"name": "query", "depth": 0}, "depth"),
    ({"name": "query", "layers": [0, 2]}, "layers"),
    ({"name": "query", "layers": "all"}, "layers"),
    ({"name": "query", "global_layers": 0}, "global_layers"),
    ({"name": "query", "global_layers": 2.5}, "global_layers"),
    ({"name": "query", "global_layers": True}, "global_layers"),
    ({"name": "query+deviation", "weight": 1.5}, "weight"),
    ({"name": "query", "keep_probe_rows": 1}, "keep_probe_rows"),
    ({"name": "deviation", "k": 4}, "k"),
]


@pytest.mark.parametrize("spec,field", BAD_SELECTORS, ids=[str(s) for s, _ in BAD_SELECTORS])
def test_bad_selector(spec, field, make_tiny_engine, tokenizer):
    with pytest.raises(ValueError, match=field):
        BlendConfig(selector=spec)
    with pytest.raises(ValueError, match=field):
        GenerateRequest(prompt="x", blend={"selector": spec})
    if isinstance(spec, dict) and spec.get("name") in SELECTORS:
        cls = SELECTORS[spec["name"]]
        options = {k: v for k, v in spec.items() if k != "name"}
        with pytest.raises(ValueError if set(options) <= {f.name for f in fields(cls)} else TypeError):
            cls(**options)


def test_probe_layers_skip_windowed_layers():
    """query probes the first 8 global layers by default; with ``global_layers`` None, the global layers of
    the first ``depth`` of the model, or the first global layer."""
    gemma_like = [512 if (i + 1) % 6 else None for i in range(18)]  # global layers 5, 11, 17
    by_depth = {"name": "query", "global_layers": None}
    assert make_selector("query").probe_layers(gemma_like) == (5, 11, 17)  # default: 8 global layers
    assert make_selector(by_depth).probe_layers(gemma_like) == (5, 11, 17)  # depth 1.0
    assert make_selector({**by_depth, "depth": 0.5}).probe_layers(gemma_like) == (5,)
    assert make_selector({**by_depth, "depth": 0.1}).probe_layers(gemma_like) == (5,)
    assert make_selector({"name": "query", "layers": [2, 11, 40]}).probe_layers(gemma_like) == (11,)
    dense = [None] * 30
    assert make_selector({**by_depth, "depth": 0.5}).probe_layers(dense) == tuple(range(1, 16))
    assert make_selector(by_depth).probe_layers(dense) == tuple(range(1, 30))
    assert make_selector("query").probe_layers(dense) == tuple(range(1, 9))


def test_probe_global_layers_count_only_global_layers():
    """``global_layers`` N probes the first N global layers from layer 1 (windowed layers not counted);
    ``layers`` wins over it, and it wins over ``depth``."""
    gemma_like = [512 if (i + 1) % 6 else None for i in range(18)]  # global layers 5, 11, 17
    assert make_selector({"name": "query", "global_layers": 1, "depth": 1.0}).probe_layers(gemma_like) == (5,)
    assert make_selector({"name": "query", "global_layers": 2}).probe_layers(gemma_like) == (5, 11)
    assert make_selector({"name": "query", "global_layers": 8}).probe_layers(gemma_like) == (5, 11, 17)
    dense = [None] * 30
    assert make_selector({"name": "query", "global_layers": 8}).probe_layers(dense) == tuple(range(1, 9))
    assert make_selector({"name": "query", "global_layers": 99}).probe_layers(dense) == tuple(range(1, 30))
    assert make_selector({"name": "query", "global_layers": 4, "layers": [7]}).probe_layers(dense) == (7,)
