"""A chunk stored with the separator that follows it in a prompt (``BlendConfig(separator_in_chunk=True)``).

Injected: chunks added with the option on (and off), then blends over them. Must hold: the stored entry is
the chunk's tokens then the separator's, holding the KV of one prefill of both after the sink; in a blend the
separator rows get that entry's rows after the chunk's (ratio 0: loaded as they are), are reused rows, not
forced ones (the query probe does not compute them; they count as cached), except for the selectors
that rank by KV deviation, which recompute them as before (and the plan's reuse estimate leaves them out);
ratio 1 is still full prefill; with the option off the separators stay forced; an entry stored one way is a
miss for a request asking the other way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import semkv.reuse.blend as blend_module
from semkv.prompt import separator_ids
from semkv.request import GenerateRequest
from semkv.reuse.options import BlendConfig
from semkv.store.keys import EntryKind
from tests.conftest import TINY_FAMILIES
from tests.reuse.test_blend import DOCS, QUESTION, _blend_seq, _engine, _first_logits

ON = BlendConfig(separator_in_chunk=True)


def _separator_spans(layout) -> list[tuple[int, int, int]]:
    """(start, end, tokens of the chunk before) of every separator that follows a chunk."""
    spans, before = [], None
    for seg, start, end in layout.spans():
        if seg.kind == "separator" and before is not None:
            spans.append((start, end, before))
        before = end - start if seg.kind == "chunk" else None
    return spans


def test_entry_is_the_chunk_then_its_separator(make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=2)
    (key,) = engine.add_chunks(DOCS[:1], ON)
    ids = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"] + separator_ids(tokenizer)
    entry = engine.store.get(key, ids, EntryKind.CHUNK)
    assert entry is not None and list(entry.token_ids) == ids and len(separator_ids(tokenizer)) > 0
    sink = [tokenizer.bos_token_id]
    cache = engine.runtime.new_cache(len(sink) + len(ids))
    engine.runtime.prefill(cache, sink + ids)
    k, v = cache.export(len(sink), len(sink) + len(ids))
    torch.testing.assert_close(entry.k, k, atol=1e-5, rtol=0)
    torch.testing.assert_close(entry.v, v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_separator_rows_come_from_the_chunk_entry(family, make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, family)
    keys = engine.add_chunks(DOCS, ON)
    seq = _blend_seq(engine, DOCS, recompute_ratio=0.0, separator_in_chunk=True)
    spans = _separator_spans(seq.layout)
    assert len(spans) == len(DOCS)
    chunk_tokens = sum(end - start for _, start, end in seq.layout.chunk_spans())
    separator_tokens = sum(end - start for start, end, _ in spans)
    assert seq.outcome.info["blend_cached_tokens"] == chunk_tokens + separator_tokens
    recomputed = set(seq.outcome.info["recomputed_rows"])
    chunks = [seg.token_ids for seg, _, _ in seq.layout.chunk_spans()]
    for (start, end, before), key, ids in zip(spans, keys, chunks, strict=True):
        assert not recomputed & set(range(start, end))
        entry = engine.store.get(key, [*ids, *separator_ids(tokenizer)], EntryKind.CHUNK)
        for layer in range(engine.num_layers):
            torch.testing.assert_close(
                seq.cache.k_pre[layer][:, start:end], entry.k[layer, :, before : before + end - start]
            )
            torch.testing.assert_close(
                seq.cache.v[layer][:, start:end], entry.v[layer, :, before : before + end - start]
            )


@pytest.mark.parametrize("on", [True, False])
def test_probe_computes_separators_only_when_they_are_not_stored(
    on, make_tiny_engine, tokenizer, monkeypatch
):
    engine = _engine(make_tiny_engine, tokenizer, "qwen2")
    config = BlendConfig(separator_in_chunk=on)
    engine.add_chunks(DOCS, config)
    probed: list[list[int]] = []
    original = blend_module.forward_fixed_rows

    def spy(runtime, cache, start, rows, *args, **kwargs):
        if kwargs.get("probe") is not None:
            probed.append((rows + start).tolist())
        return original(runtime, cache, start, rows, *args, **kwargs)

    monkeypatch.setattr(blend_module, "forward_fixed_rows", spy)
    seq = _blend_seq(engine, DOCS, recompute_ratio=0.3, selector="query", separator_in_chunk=on)
    separators = {row for start, end, _ in _separator_spans(seq.layout) for row in range(start, end)}
    assert len(probed) == 1 and separators
    if on:
        assert not separators & set(probed[0])
    else:
        assert separators <= set(probed[0])


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("selector", ["deviation", "query+deviation"])
def test_deviation_selectors_recompute_the_separators_either_way(
    family, selector, make_tiny_engine, tokenizer
):
    """Selectors that rank by KV deviation keep the separators forced when they are stored with the chunk:
    the same recomputed rows (the separators among them) and logits as with the separators not stored."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS, ON)
    engine.add_chunks(DOCS, BlendConfig(separator_in_chunk=False))
    stored, stored_stats = _first_logits(
        engine, DOCS, reuse="blend", blend=BlendConfig(0.3, selector, separator_in_chunk=True)
    )
    apart, apart_stats = _first_logits(
        engine, DOCS, reuse="blend", blend=BlendConfig(0.3, selector, separator_in_chunk=False)
    )
    assert stored_stats["chunk_hits"] == apart_stats["chunk_hits"] == len(DOCS)
    assert stored_stats["recomputed_rows"] == apart_stats["recomputed_rows"]
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=DOCS))
    separators = {row for start, end, _ in _separator_spans(layout) for row in range(start, end)}
    assert separators <= set(stored_stats["recomputed_rows"])
    torch.testing.assert_close(stored, apart, atol=1e-6, rtol=0)


@pytest.mark.parametrize("selector", ["query", "deviation"])
def test_plan_counts_stored_separators_as_reused_only_when_they_are(selector, make_tiny_engine, tokenizer):
    """The plan's reuse estimate (what "auto" compares paths by) counts a stored separator's rows as reused
    rows for a selector that reuses them, and not for one that recomputes them (deviation): then it is the
    estimate of the same blend over chunks stored without their separators."""
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=2)
    engine.add_chunks(DOCS, ON)
    engine.add_chunks(DOCS, BlendConfig(separator_in_chunk=False))
    request = GenerateRequest(prompt=QUESTION, chunks=DOCS, reuse="blend", store_prompt=False)
    estimates = {}
    for on in (True, False):
        blend = BlendConfig(0.2, selector, separator_in_chunk=on)
        plan, _ = engine.plan(dataclasses.replace(request, blend=blend))
        assert plan.path == "blend"
        estimates[on] = plan.reused_tokens
    separators = sum(end - start for start, end, _ in _separator_spans(engine.layout(request)))
    counted = int(separators * 0.8) if selector == "query" else 0
    assert abs(estimates[True] - estimates[False] - counted) <= 1


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_ratio_one_is_full_prefill(family, make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS, ON)
    full, _ = _first_logits(engine, DOCS, reuse="none")
    one, stats = _first_logits(engine, DOCS, reuse="blend", blend=BlendConfig(1.0, separator_in_chunk=True))
    assert stats["path"] == "blend" and stats["chunk_hits"] == len(DOCS) and stats["reused_tokens"] == 0
    torch.testing.assert_close(one, full, atol=1e-4, rtol=0)


def test_stored_one_way_is_a_miss_the_other_way(make_tiny_engine, tokenizer):
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=2)
    engine.add_chunks(DOCS[:2], ON)
    _, stats = _first_logits(engine, DOCS[:2], reuse="blend", blend={"separator_in_chunk": False})
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (0, 2)
    _, stats = _first_logits(engine, DOCS[:2], reuse="blend", blend={"separator_in_chunk": True})
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (2, 0)


def test_bad_value_names_the_field():
    with pytest.raises(ValueError, match="separator_in_chunk"):
        BlendConfig(separator_in_chunk="yes")
