"""The blend's fixed-row passes compute what ``Runtime.forward_rows`` computes.

A query probe and a recompute whose rows are known before the forward (check layer 0, a selector that does
not rank by KV deviation) run only their rows from layer 0 on (``forward_fixed_rows``), and the chunk rows
are loaded layer by layer in one call (``Runtime.load_pieces``). Each is checked here against the general
mechanism on the same loaded rows: the probe's scores, the recompute's chosen rows, first-token logits
and every row's KV at every layer (layer 0 included: there the rows left out keep the stored KV, which a
forward over every row would have rewritten with the same values).
"""

from __future__ import annotations

import copy

import pytest
import torch

from semkv.engine import Engine
from semkv.models.cache import KVCache
from semkv.models.staging import RowSource
from semkv.request import GenerateRequest
from semkv.reuse.blend import _stored_rows
from semkv.reuse.selection.base import RowInfo
from semkv.reuse.selection.registry import make_selector
from semkv.reuse.selective import QueryProbe, SelectiveRecompute, forward_fixed_rows
from semkv.store.keys import EntryKind, chunk_key
from tests.conftest import TINY_FAMILIES
from tests.reuse.test_blend import DOCS, QUESTION, _engine, _laid_out, _stored_spans


def _loaded(engine: Engine) -> tuple[KVCache, RowInfo]:
    """The blend's rows (no exact prefix) loaded by ``Runtime.load_pieces``, and what each row is (the separator
    after a chunk comes from the chunk's entry, as chunks are stored with it by default)."""
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=DOCS))
    cache = engine.runtime.new_cache(len(layout))
    entries = [_entry(engine, ids) for _, _, ids in _stored_spans(engine, layout)]
    pieces, forced, query, offsets = [], [], [], []
    for seg, start, end, entry, at in _stored_rows(layout, entries, True):
        n = end - start
        pieces.append(
            RowSource.empty(n)
            if entry is None
            else RowSource(entry.k[:, :, at : at + n], entry.v[:, :, at : at + n])
        )
        forced += [entry is None] * n
        query += [seg.kind in ("body", "suffix")] * n
        offsets += list(range(at, at + n)) if entry is not None else [-1] * n
    engine.runtime.load_pieces(cache, pieces, engine.runtime.positions(0, len(layout)), layout.token_ids)
    return cache, RowInfo(torch.tensor(forced), torch.tensor(query), torch.tensor(offsets))


def _entry(engine: Engine, ids: list[int]):
    entry = engine.store.get(chunk_key(engine.fingerprint, ids), ids, EntryKind.CHUNK)
    assert entry is not None
    return entry


def _assert_same_kv(a: KVCache, b: KVCache, layers: range, rows: torch.Tensor | slice) -> None:
    for layer in layers:
        for name in ("k_pre", "k_rot", "v"):
            x, y = getattr(a, name)[layer][:, rows], getattr(b, name)[layer][:, rows]
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"{name} of layer {layer}")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_loading_in_one_piece_is_loading_chunk_by_chunk(family, make_tiny_engine, tokenizer):
    """Chunk rows (and their separators) hold the stored KV re-rotated to their positions, bit for bit what
    one ``Runtime.load_rows`` per chunk writes; the other rows hold zeros."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS)
    cache, rows = _loaded(engine)
    layout = engine.layout(GenerateRequest(prompt=QUESTION, chunks=DOCS))
    reference = engine.runtime.new_cache(len(layout))
    for _, start, end, entry in _laid_out(engine, layout):
        ids = layout.token_ids[start:end]
        if entry is not None:
            engine.runtime.load_rows(reference, entry.k, entry.v, torch.arange(start, end), ids)
        else:
            reference.append_rows(torch.arange(start, end), ids)
    assert cache.length == reference.length and cache.token_ids == reference.token_ids
    assert torch.equal(cache.valid_positions(), reference.valid_positions())
    chunk_rows = ~rows.forced
    for layer in range(engine.num_layers):
        for name in ("k_pre", "k_rot", "v"):
            mine, theirs = getattr(cache, name)[layer], getattr(reference, name)[layer]
            assert torch.equal(
                mine[:, : cache.length][:, chunk_rows], theirs[:, : cache.length][:, chunk_rows]
            )
            assert not bool(mine[:, : cache.length][:, rows.forced].any())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_fixed_row_probe_scores_as_forward_rows(family, make_tiny_engine, tokenizer):
    """The probe over its forced rows alone records the scores the probe through ``forward_rows`` does,
    and writes the same KV for its rows at every layer through its last."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS)
    cache, rows = _loaded(engine)
    windows = [engine.adapter.window(layer) for layer in range(engine.num_layers)]
    layers = make_selector("query").probe_layers(windows)
    general, fixed = QueryProbe(rows, layers), QueryProbe(rows, layers)
    general_cache, fixed_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    engine.runtime.forward_rows(general_cache, 0, general)
    assert (
        forward_fixed_rows(engine.runtime, fixed_cache, 0, rows.forced.nonzero().squeeze(1), probe=fixed)
        is None
    )
    assert float(general.scores.sum()) > 0
    torch.testing.assert_close(fixed.scores, general.scores, atol=1e-6, rtol=1e-6)
    _assert_same_kv(fixed_cache, general_cache, range(max(layers) + 1), rows.forced[: cache.length])


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("selector", ["query", {"name": "chunk-start", "k": 4}, "random"])
def test_preselected_recompute_is_the_selective_forward(family, selector, make_tiny_engine, tokenizer):
    """With the rows known before the forward, running just them from layer 0 gives ``forward_rows``'
    logits, chooses the same rows, and leaves every row's KV as it does at every layer."""
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS)
    cache, rows = _loaded(engine)
    chosen = make_selector(selector)
    probe = None
    if chosen.needs_probe:
        windows = [engine.adapter.window(layer) for layer in range(engine.num_layers)]
        prober = QueryProbe(rows, chosen.probe_layers(windows))
        engine.runtime.forward_rows(copy.deepcopy(cache), 0, prober)
        probe = prober.scores
    general = SelectiveRecompute(rows, {0: 0.3}, chosen, probe)
    fixed = SelectiveRecompute(rows, {0: 0.3}, chosen, probe)
    general_cache, fixed_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    expected = engine.runtime.forward_rows(general_cache, 0, general)
    keep = fixed.preselect()
    assert keep is not None
    logits = forward_fixed_rows(engine.runtime, fixed_cache, 0, keep)
    assert torch.equal(fixed.recomputed_rows(), general.recomputed_rows())
    selected = int((~rows.forced[keep]).sum())
    assert 0 < selected < int((~rows.forced).sum())  # a real selection: some chunk rows in, some out
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    _assert_same_kv(fixed_cache, general_cache, range(engine.num_layers), slice(0, cache.length))


def test_deviation_and_later_check_layers_are_not_preselected():
    """A choice that needs the forward (KV deviation, a check layer past 0, gradual filtering) is made in it."""
    rows = RowInfo.plain(torch.tensor([True, False, False, True]))
    assert SelectiveRecompute(rows, {1: 0.5}, make_selector("deviation")).preselect() is None
    assert SelectiveRecompute(rows, {0: 0.5}, make_selector("query+deviation")).preselect() is None
    assert SelectiveRecompute(rows, {1: 0.5}, make_selector("chunk-start")).preselect() is None
    assert SelectiveRecompute(rows, {0: 0.5, 1: 0.3}, make_selector("random")).preselect() is None
    picked = SelectiveRecompute(rows, {0: 0.5}, make_selector("random")).preselect()
    assert picked is not None and picked.tolist()[0] == 0 and picked.tolist()[-1] == 3 and picked.numel() == 3
