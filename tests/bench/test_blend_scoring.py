"""How the blend bench scores HotpotQA answers and summarises a row.

Injected: generations as SmolLM2 / Gemma 3 write them on the dev split ("The answer is: X.",
"\\nAnswer: X\\n\\nQuestion: ..."), hand-made records for three questions. Must happen: EM / F1 are
HotpotQA's on the extracted answer, em_raw / f1_raw on the first line as is; a row's summary means both,
pairs its F1 with full prefill's, and counts agreement with full prefill on the extracted answers.
"""

from __future__ import annotations

import pytest

from semkv.bench.blend import score_essay, score_hotpot, summarise


def test_hotpot_scoring_gives_extracted_and_raw_figures():
    scores = score_hotpot("The answer is: Dave Brockie.", "Dave Brockie")
    # raw first line "The answer is: Dave Brockie." -> "answer is dave brockie": P 2/4, R 1, F1 2/3
    assert scores == {"em": 1.0, "f1": 1.0, "em_raw": 0.0, "f1_raw": pytest.approx(2 / 3)}


def test_essay_scoring_has_no_raw_columns():
    assert score_essay("Her code word is falcon.", "falcon") == {"em": 1.0, "f1": 1.0}


def _record(text: str, gold: str) -> dict:
    from semkv.evaluation.hotpotqa import extract_answer

    return {
        "text": text,
        "extracted": extract_answer(text),
        **score_hotpot(text, gold),
        "ttft_s": 1.0,
        "prompt_tokens": 10,
        "recomputed": 10,
        "loop": False,
        "kl": 0.0,
        "top1": True,
    }


def test_a_row_summary_means_extracted_and_raw_scores_and_agrees_on_extracted_answers():
    gold = ["Dave Brockie", "1989", "Columbus"]
    full = [
        _record(t, g)
        for t, g in zip(["The answer is: Dave Brockie.", "\nAnswer: 1989\n", "Dallas"], gold, strict=True)
    ]
    # row: same answers as full on the first two (different wording), wrong on the third
    row = [
        _record(t, g)
        for t, g in zip(["Answer: Dave Brockie", "The answer is 1989.", "Ohio"], gold, strict=True)
    ]
    summary = summarise("hotpotqa", "row", row, full)
    assert summary["em"] == pytest.approx(2 / 3) and summary["f1"] == pytest.approx(2 / 3)
    # raw first lines: "Answer: Dave Brockie" F1 0.8, "The answer is 1989." F1 0.5 (P 1/3: "the" dropped)
    assert summary["em_raw"] == 0.0 and summary["f1_raw"] == pytest.approx((0.8 + 0.5) / 3)
    assert summary["agree_full"] == pytest.approx(2 / 3)  # first lines all differ; answers agree on two
    assert summary["f1_diff"] == pytest.approx(0.0)


def test_a_row_summary_pairs_speed_ups_per_question():
    """Full prefill 2 / 4 / 8 s, the row 1 / 1 / 4 s on the same questions: per-question speed-ups 2, 4, 2
    (geometric mean 2^(4/3)); the ratio of medians (4 / 1 = 4) pairs no question with itself."""
    full = [{**_record("1989", "1989"), "ttft_s": t} for t in (2.0, 4.0, 8.0)]
    row = [{**_record("1989", "1989"), "ttft_s": t} for t in (1.0, 1.0, 4.0)]
    summary = summarise("hotpotqa", "row", row, full)
    assert summary["speedup"] == pytest.approx(4.0)
    assert summary["speedup_paired"] == pytest.approx(2 ** (4 / 3))
    assert summary["speedup_low"] < summary["speedup_paired"] < summary["speedup_high"]
