"""A decaying recompute schedule at its floor gathers no reused KV.

Injected: blend rows loaded into a tiny llama's cache (6 layers) and a deviation recompute whose schedule
decays to a floor (layer 1: 50% of the reusable rows, layer 2: 25%, layers 3-5: 25%), as share's
exponential schedule does; the same forward again with the reused KV gathered at every scheduled layer.

Must happen: the runtime asks for the reused KV at layers 1 and 2 only (from layer 3 on the budget covers
every reusable row still active: nothing to rank), and both forwards choose the same rows at every layer
and give the same first-token logits.
"""

from __future__ import annotations

import copy

import torch

from semkv.reuse.selective import SelectiveRecompute, deviation_recompute
from tests.reuse.test_blend import DOCS, _engine
from tests.reuse.test_fixed_rows import _loaded

SCHEDULE = {1: 0.5, 2: 0.25, 3: 0.25, 4: 0.25, 5: 0.25}


def test_layers_whose_budget_covers_the_rows_left_are_not_compared(make_tiny_engine, tokenizer, monkeypatch):
    engine = _engine(make_tiny_engine, tokenizer, "llama", layers=6)
    engine.add_chunks(DOCS)
    cache, rows = _loaded(engine)
    twin = copy.deepcopy(cache)

    asked: list[tuple[int, bool]] = []
    real = SelectiveRecompute.compares_at

    def recorded(self: SelectiveRecompute, layer: int) -> bool:
        answer = real(self, layer)
        asked.append((layer, answer))
        return answer

    monkeypatch.setattr(SelectiveRecompute, "compares_at", recorded)
    floor = deviation_recompute(rows.forced, SCHEDULE)
    logits = engine.runtime.forward_rows(cache, 0, floor)
    assert [layer for layer, answer in asked if answer] == [1, 2]

    monkeypatch.setattr(SelectiveRecompute, "compares_at", lambda self, layer: layer in self.schedule)
    every = deviation_recompute(rows.forced, SCHEDULE)
    want = engine.runtime.forward_rows(twin, 0, every)
    assert set(floor.chosen) == set(every.chosen) == set(SCHEDULE)
    for layer in SCHEDULE:
        assert torch.equal(floor.chosen[layer], every.chosen[layer]), layer
    torch.testing.assert_close(logits, want, atol=0, rtol=0)
