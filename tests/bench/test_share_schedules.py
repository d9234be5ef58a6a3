"""``semkv bench share --first-hit --schedules``: parsing, the summary, and the sweep on a tiny engine.

Injected: malformed schedule strings; hand-made per-target rows where the second schedule's first hit costs
exactly half the first's and its KL is 0.01 higher; a tiny random model serving one target under two schedules.
Must happen: clear errors naming what is wrong; the summary's speed-ups and paired differences come out as
built; each schedule's first hit is served by share on its own reference, with the schedule's own recompute
(a smaller schedule recomputes fewer rows).
"""

from __future__ import annotations

import pytest

from semkv.bench.share_schedules import Schedule, parse_schedules, serve_schedules, summarise


def test_schedules_parse_and_bad_ones_say_what_is_wrong() -> None:
    schedules = parse_schedules("0.2/0.8/0.02, 0.1/0.6/0.01")
    assert [s.name for s in schedules] == ["0.2/0.8/0.02", "0.1/0.6/0.01"]
    assert schedules[1].config().ratios(3) == {1: 0.1, 2: pytest.approx(0.06)}
    windowed = parse_schedules("0.1/0.6/0.01/64")[0]
    assert windowed.name == "0.1/0.6/0.01/64" and windowed.config().layer0_window == 64
    assert schedules[1].config().layer0_window == 0
    for bad, message in (
        ("0.1/0.6", "first_ratio/decay/min_ratio"),
        ("0.1/0.6/0.01/8/2", r"first_ratio/decay/min_ratio\[/layer0_window\]"),
        ("0.1/x/0.01", "must be numbers"),
        ("0.1/0.6/0.01/6.5", "must be numbers"),
        ("0.1/0.6/0.01/-4", r"layer0_window must be in \[0, "),
        ("1.5/0.6/0.01", r"first_ratio must be a number in \[0, 1\]"),
        ("0.1/0.6/0.01,0.1/0.6/0.01", "twice"),
        (" , ", "at least one"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_schedules(bad)


def _rows(n: int = 5) -> list[dict]:
    out = []
    for i in range(n):
        full = 2.0 + 0.2 * i
        out.append(
            {
                "paper": f"p{i}",
                "edit_pct": 10,
                "prompt_tokens": 1900 + i,
                "ttft_full": full,
                "schedules": {
                    "0.2/0.8/0.02": {
                        "path": "share",
                        "ttft": full / 4,
                        "kl_first": 0.01 * i,
                        "rougeL_vs_full": 0.8,
                        "recompute_frac": 0.12,
                    },
                    "0.1/0.6/0.01": {
                        "path": "share",
                        "ttft": full / 8,
                        "kl_first": 0.01 * i + 0.01,
                        "rougeL_vs_full": 0.8,
                        "recompute_frac": 0.1,
                    },
                },
            }
        )
    return out


def test_summary_pairs_each_schedule_with_full_prefill_and_the_baseline() -> None:
    summary = summarise(_rows(), parse_schedules("0.2/0.8/0.02,0.1/0.6/0.01"))
    base, other = summary
    assert base["speedup_first"] == pytest.approx(4.0) and other["speedup_first"] == pytest.approx(8.0)
    assert base["kl_vs_base"].startswith("+0.0000") and other["kl_vs_base"].startswith("+0.0100")
    assert other["kl_first"] == pytest.approx(base["kl_first"] + 0.01)
    assert other["rougeL_vs_base"].startswith("+0.000") and other["n"] == 5 and other["share_taken"] == 5
    assert other["recompute_frac"] == pytest.approx(0.1)


def test_each_schedule_is_served_by_share_on_its_own_reference(make_tiny_engine, tokenizer) -> None:
    from semkv.evaluation.essays import haystack

    engine = make_tiny_engine("llama")
    doc = haystack(tokenizer, 300, start_essay=3)
    target = {
        "paper": "p",
        "edit_pct": 10,
        "reference": "Summarise the following text.\n\n" + doc,
        "target": "Please write a brief summary of this document.\n\n" + doc,
    }
    wide, narrow = Schedule(0.5, 1.0, 0.5), Schedule(0.0, 0.5, 0.0)
    row = serve_schedules(engine, target, "salt", [wide, narrow], max_new_tokens=2)
    served = row["schedules"]
    assert [served[s.name]["path"] for s in (wide, narrow)] == ["share", "share"]
    assert served[narrow.name]["recompute_frac"] < served[wide.name]["recompute_frac"]
    assert row["ttft_full"] > 0 and all(served[s.name]["ttft"] > 0 for s in (wide, narrow))
