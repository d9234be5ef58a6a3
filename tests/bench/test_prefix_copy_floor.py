"""``semkv bench prefix`` reports, beside each hit's TTFT, one copy of the KV bytes it reuses and one decode
step at that length, from the same run, and the same hit served from the store (page pool emptied).

Injected: nothing; the bench's own prefix-reuse measurement on a tiny engine (one repeat). Must happen:
every row carries the reused KV in MiB (its reused tokens times the live cache's bytes per token), a
positive copy time and decode-step time, and the hit's cost beyond the step in copies of its bytes; the
answers of the hit equal full prefill's.
"""

from __future__ import annotations

import pytest

from semkv.bench.prefix import QUESTIONS, copy_seconds, prefix_reuse


def test_each_row_puts_the_hit_next_to_a_copy_and_a_decode_step(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    document = " ".join(f"Sentence {i} says the harbour opened at dawn." for i in range(40))
    rows = prefix_reuse(engine, document, repeats=1)
    assert len(rows) == len(QUESTIONS) - 1
    for row in rows:
        assert row["reused_tokens"] > 0 and row["answers_identical"]
        assert row["pooled_blocks"] == row["reused_tokens"] // 4  # every block hit in the pool
        assert row["ttft_prefix_from_store_s"] > 0
        assert row["speedup_from_store"] == pytest.approx(
            row["ttft_full_s"] / row["ttft_prefix_from_store_s"]
        )
        assert row["reused_kv_mib"] == pytest.approx(
            row["reused_tokens"] * engine.kv_bytes_per_token() / 2**20
        )
        assert row["copy_s"] > 0 and row["decode_step_s"] > 0
        expected = (row["ttft_prefix_s"] - row["decode_step_s"]) / row["copy_s"]
        assert row["hit_beyond_step_over_copy"] == pytest.approx(expected)


def test_a_copy_of_more_bytes_is_timed():
    assert copy_seconds(1 << 20, repeats=3) > 0
