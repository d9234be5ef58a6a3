"""The prefix bench's sharing rows time a single sequence's step and a batch's step in turns.

Injected: an engine whose decode steps are recorded in order (no model: the order of calls is what is
tested) and a clock that advances by a known amount per call, 1 s for the single sequence, 3 s for the batch.

Must happen: the two alternate, the order flipping every step (so neither always runs first, on a cache
the other just warmed); the first two steps of each are excluded; the medians are each one's own time, the ratio the median of the step-by-step ratios.
"""

from __future__ import annotations

import semkv.bench.prefix as prefix_bench


class RecordingEngine:
    def __init__(self, clock: list[float]) -> None:
        self.calls: list[str] = []
        self.clock = clock

    def decode_batch(self, seqs: list[str]) -> None:
        self.calls.append(seqs[0])
        self.clock[0] += 1.0 if seqs[0] == "one" else 3.0


def test_steps_alternate_and_the_medians_are_each_ones_own(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(prefix_bench.time, "perf_counter", lambda: clock[0])
    engine = RecordingEngine(clock)
    one, batch, ratio = prefix_bench._paired_step_seconds(engine, ["one"], ["batch", "batch"], steps=4)
    assert engine.calls == ["batch", "one", "one", "batch"] * 3
    assert (one, batch, ratio) == (1.0, 3.0, 3.0)
