"""The serving mix of ``semkv bench batching --sweep``: its builder, latency measures and sweep helpers.

Injected: loads of several sizes and seeds over fake document ids and passages; chunk arrival times;
outcomes with known TTFTs, chunk times and token counts. Must happen: the mix has the configured
share of each kind (two-turn kinds whole), every kind at least once, the same seed gives the same
load and another seed another order; a follow-up sends its first turn, that turn's answer and the new
question, in order; inter-token latencies are the gaps between consecutive chunks; a point's figures
(tokens/s, requests/s, TTFT and ITL percentiles) follow from the outcomes; bad sweeps are refused.
"""

from __future__ import annotations

import pytest

from semkv.bench.batching_long import server_configs
from semkv.bench.batching_sweep import parse_counts, requests_for, sweep_rows
from semkv.bench.serve import Outcome, percentile
from semkv.bench.serving_mix import (
    MIX,
    TURNS,
    Turn,
    build_mix,
    gaps,
    mix_counts,
    point_summary,
    turn_messages,
)

IDS = [f"doc-{i}" for i in range(8)]
PASSAGES = [f"passage {i} " * 20 for i in range(4)]
LONG = ["long passage " * 500]
SPARSE = {"sparse": "quest", "kv_budget": 0.1}


def make(requests: int, seed: int = 0):
    return build_mix(requests, seed, IDS, PASSAGES, LONG, 3, SPARSE)


@pytest.mark.parametrize("requests", [6, 8, 16, 32, 100])
def test_mix_has_each_kind_in_its_share(requests):
    counts = mix_counts(requests)
    assert sum(counts.values()) == requests and all(n >= 1 for n in counts.values())
    for kind, share in MIX.items():
        assert counts[kind] % TURNS[kind] == 0
        if requests >= 32:  # rounding to whole items matters less as the load grows
            assert abs(counts[kind] / requests - share) <= 0.05, (kind, counts)
    items = make(requests)
    sent = {kind: sum(len(i.turns) for i in items if i.kind == kind) for kind in MIX}
    assert sent == counts


def test_mix_is_seeded():
    assert make(16, seed=1) == make(16, seed=1)
    assert [i.kind for i in make(16, seed=1)] != [i.kind for i in make(16, seed=2)]


def test_mix_requests_name_what_each_kind_needs():
    items = make(32)
    for item in items:
        assert all(t.semkv["reuse"] == "auto" for t in item.turns)
        if item.kind == "rag":
            docs = item.turns[0].semkv["documents"]
            assert len(docs) == 3 == len(set(docs)) and set(docs) <= set(IDS)
        if item.kind == "long":
            assert item.turns[0].semkv["sparse"] == "quest" and item.turns[0].semkv["kv_budget"] == 0.1
            assert LONG[0] in item.turns[0].messages[0]["content"]
        if item.kind == "reworded":
            first, second = (t.messages[0]["content"] for t in item.turns)
            assert first != second and first.split("\n\n", 1)[1] == second.split("\n\n", 1)[1]
        if item.kind == "chat":
            assert not item.turns[0].follow_up and item.turns[1].follow_up


def test_follow_up_extends_its_first_turn():
    chat = next(i for i in make(8) if i.kind == "chat")
    first = turn_messages(chat.turns[0], None, None)
    second = turn_messages(chat.turns[1], first, "The answer.")
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": "The answer."}
    assert second[len(first) + 1 :] == list(chat.turns[1].messages)
    with pytest.raises(ValueError, match="previous turn"):
        turn_messages(chat.turns[1], None, None)
    plain = Turn(({"role": "user", "content": "hi"},), {})
    assert turn_messages(plain, first, "ignored") == [{"role": "user", "content": "hi"}]


def test_mix_refuses_bad_sizes():
    with pytest.raises(ValueError, match="requests must be >= 6"):
        mix_counts(5)
    with pytest.raises(ValueError, match="docs_per_request"):
        build_mix(8, 0, IDS[:2], PASSAGES, LONG, 3, SPARSE)


def test_gaps_and_percentiles():
    assert gaps([1.0, 1.5, 1.75, 3.0]) == [0.5, 0.25, 1.25]
    assert gaps([2.0]) == [] and gaps([]) == []
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0


def test_point_summary():
    outcomes = [
        Outcome(0, 0.5, 2.0, "a", {"generated_tokens": 3, "path": "blend"}, [1.0, 1.1, 1.4]),
        Outcome(1, 1.5, 3.0, "b", {"generated_tokens": 5, "path": "prefix"}, [2.0, 2.2]),
    ]
    row = point_summary(outcomes, ["rag", "chat"], wall_s=4.0)
    assert row["output_tokens_per_s"] == 2.0 and row["requests_per_s"] == 0.5
    assert row["ttft_p50_s"] == 0.5 and row["ttft_p99_s"] == 1.5
    assert row["itl_p50_ms"] == pytest.approx(200.0) and row["itl_p99_ms"] == pytest.approx(300.0)
    assert row["paths"] == "chat:prefixx1 rag:blendx1"


def test_sweep_arguments():
    assert parse_counts("1,2,4,8,16") == [1, 2, 4, 8, 16]
    for bad in ("", "0,1", "4,2", "1,1", "a"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_counts(bad)
    assert [requests_for(c, 8) for c in (1, 2, 4, 8, 16)] == [8, 8, 8, 16, 32]
    labels = [label for label, _ in server_configs("256,512")]
    assert labels[-1] == "no chunked prefill" and len(labels) == 3
    assert server_configs("256")[0][1] == ["--max-batched-tokens", "256"]
    with pytest.raises(ValueError, match="--chunk-sizes"):
        server_configs("8")


def test_sweep_rows_put_the_modes_side_by_side():
    def point(tokens_per_s: float, ttft: float, texts: list[str]):
        summary = {
            "requests": len(texts),
            "output_tokens_per_s": tokens_per_s,
            "requests_per_s": tokens_per_s / 10,
            "ttft_p50_s": ttft,
            "ttft_p99_s": 2 * ttft,
            "itl_p50_ms": 30.0,
            "itl_p99_ms": 60.0,
        }
        return summary, [Outcome(i, ttft, 1.0, t) for i, t in enumerate(texts)]

    results = {
        "no batching": {1: point(10.0, 1.0, ["a", "b"]), 4: point(12.0, 4.0, ["a", "b"])},
        "batching": {1: point(11.0, 1.0, ["a", "b"]), 4: point(30.0, 0.5, ["a", "x"])},
    }
    rows = sweep_rows([1, 4], results)
    assert [r["clients"] for r in rows] == [1, 4]
    assert rows[0]["tokens_per_s_ratio"] == pytest.approx(1.1) and rows[1]["tokens_per_s_ratio"] == 2.5
    assert rows[1]["off_ttft_p50_s"] == 4.0 and rows[1]["on_ttft_p50_s"] == 0.5
    assert rows[1]["on_ttft_p99_s"] == 1.0 and rows[1]["off_itl_p99_ms"] == 60.0
    assert rows[0]["same_answers"] == 1.0 and rows[1]["same_answers"] == 0.5
