"""``semkv bench share --first-hit``'s summary, model-free: hand-made timings of known ratios.

Injected: per-target rows whose first hit costs exactly 1.5x the repeated hit and 1/4 of full prefill.
Must happen: the paired speed-ups, first / repeat and the ROUGE-L mean come out as built, each with an
interval around it, and the targets check names a missed target "NOT met" (4x < 5x; 1.5 > 1.3).
"""

from __future__ import annotations

import pytest

from semkv.bench.share_first import summarise, targets_check


def rows(edit: int, n: int = 6) -> list[dict]:
    out = []
    for i in range(n):
        full = 2.0 + 0.1 * i
        out.append(
            {
                "edit_pct": edit,
                "prompt_tokens": 2000,
                "path": "share",
                "ttft_full": full,
                "ttft_share_first": full / 4,
                "ttft_share_repeat": full / 6,
                "rougeL_vs_full": 0.6 + 0.04 * i,
                "kl_first": 0.1,
                "same_text": False,
                "recompute_frac": 0.15,
            }
        )
    return out


def test_summary_reports_paired_ratios_and_checks_targets() -> None:
    summary = summarise(rows(10) + rows(30))
    assert [s["edit_pct"] for s in summary] == [10, 30]
    s = summary[0]
    assert s["n"] == 6 and s["share_taken"] == 6
    assert s["speedup_first"] == pytest.approx(4.0) and s["speedup_repeat"] == pytest.approx(6.0)
    assert s["first_over_repeat"] == pytest.approx(1.5)
    assert s["rougeL_vs_full"] == pytest.approx(0.7)
    low, high = (float(x) for x in s["rougeL_vs_full_ci"].strip("[]").split(","))
    assert low < 0.7 < high
    text = targets_check(summary)
    assert "first-hit TTFT 4.00x" in text and "target >= 5x: NOT met" in text  # 10% edits
    assert "target >= 4x: met" in text  # 30% edits
    assert "first hit / repeated hit 1.50x" in text and "target <= 1.3: NOT met" in text


def test_serve_target_on_a_tiny_engine(make_tiny_engine, tokenizer) -> None:
    """The workload end to end on a tiny random model: a fresh namespace per target, share taken on the first
    hit, every timing and quality field filled."""
    from semkv.bench.share_first import serve_target
    from semkv.evaluation.essays import haystack

    engine = make_tiny_engine("llama")
    doc = haystack(tokenizer, 300, start_essay=3)
    target = {
        "paper": "p",
        "edit_pct": 10,
        "place": "before",
        "reference": "Summarise the following text.\n\n" + doc,
        "target": "Please write a brief summary of this document.\n\n" + doc,
    }
    row = serve_target(engine, target, "salt-a", max_new_tokens=3, repeats=2)
    assert row["path"] == "share" and row["repeat_path"] == "share"
    assert row["ttft_full"] > 0 and row["ttft_share_first"] > 0 and row["ttft_share_repeat"] > 0
    assert row["first_over_repeat"] == pytest.approx(row["ttft_share_first"] / row["ttft_share_repeat"])
    assert 0.0 <= row["rougeL_vs_full"] <= 1.0
