"""``semkv bench blend --dataset squad``: the second prompt format (SQuAD, extractive, article order).

Injected: real SQuAD v2.0 dev questions of the seeded dev split, a word-count cost, and generations
wrapped as the models wrap them. Must happen: each case holds the question's own paragraph (``gold``)
and its article's neighbouring paragraphs in the article's order within the budget; the ``shuffled`` and
``joined`` layouts hold the same paragraphs (seeded order; the article's as one chunk whose text is what
the prompt reads for them in the article layout); the layout stays within ``--target-tokens``; scoring
takes the best of the annotators' answers and counts a reply holding one as correct.
"""

from __future__ import annotations

import pytest

from semkv.bench.blend import (
    SQUAD_ANSWERS_SEPARATOR,
    score_squad,
    squad_chunks,
    squad_layouts,
    squad_workload,
)
from semkv.evaluation.corpora import squad_articles, squad_split
from semkv.prompt import CHUNK_SEPARATOR, build_layout


def words(text: str) -> int:
    return len(text.split())


def test_chunks_keep_the_article_order_around_the_gold_paragraph():
    item = squad_split("dev")[0]
    article = list(squad_articles()[item.article])
    budget = 3 * words(item.context) + 200
    laid = squad_chunks(item, budget, words)
    chunks, gold = laid.chunks, laid.gold
    assert chunks[gold] == item.context
    assert sum(words(c) for c in chunks) <= budget
    own = [c for c in chunks if c in article]
    assert own == sorted(own, key=article.index)  # the article's order
    start = article.index(own[0])
    assert own == article[start : start + len(own)]  # contiguous around the question's paragraph
    assert chunks[: laid.own] == own


def test_shuffled_and_joined_layouts_hold_the_same_paragraphs():
    item = squad_split("dev")[1]
    laid = squad_chunks(item, 6 * words(item.context) + 400, words)
    assert laid.own >= 2  # the case has neighbours to shuffle and join
    shuffled = laid.laid_out("shuffled", "0:x")
    assert sorted(shuffled.chunks) == sorted(laid.chunks) and shuffled.chunks != laid.chunks
    assert shuffled.chunks[shuffled.gold] == item.context
    assert shuffled == laid.laid_out("shuffled", "0:x")  # seeded
    joined = laid.laid_out("joined", "0:x")
    assert joined.gold == 0 and joined.own == 1
    assert joined.chunks[0] == CHUNK_SEPARATOR.join(laid.chunks[: laid.own])
    assert joined.chunks[1:] == laid.chunks[laid.own :]
    # the prompt joins chunks with the separator: the joined layout reads the same text
    assert CHUNK_SEPARATOR.join(joined.chunks) == CHUNK_SEPARATOR.join(laid.chunks)
    assert laid.laid_out("article", "0:x") == laid
    with pytest.raises(ValueError, match="unknown squad layout"):
        laid.laid_out("reversed", "0:x")


def test_layout_names_are_checked():
    assert squad_layouts("article, joined") == ["article", "joined"]
    for bad in ("", "article,sideways"):
        with pytest.raises(ValueError, match="--squad-layout"):
            squad_layouts(bad)


def test_workload_fits_its_target(tokenizer):
    workload = squad_workload(tokenizer, "dev", 3, 0, 1024)
    assert workload.name == "squad" and len(workload.cases) == 3
    joined = squad_workload(tokenizer, "dev", 3, 0, 1024, "joined")
    assert joined.name == "squad joined"
    for case, item, other in zip(workload.cases, squad_split("dev")[:3], joined.cases, strict=True):
        assert case.chunks[case.gold[0]] == item.context
        assert item.context in other.chunks[other.gold[0]]
        assert case.answer.split(SQUAD_ANSWERS_SEPARATOR) == list(item.answers)
        assert len(build_layout(tokenizer, messages=case.messages, chunks=case.chunks)) <= 1024
        assert not any(m["role"] == "system" for m in case.messages)  # the template's own system turn


def test_score_takes_the_best_answer_and_counts_a_reply_holding_one():
    answers = SQUAD_ANSWERS_SEPARATOR.join(["the Normans", "Normans in France", "France"])
    assert score_squad("The answer is: Normans.", answers) == {"em": 1.0, "f1": 1.0, "correct": 1.0}
    held = score_squad("They settled in Normandy, France, in the 10th century", answers)
    assert held["em"] == 0.0 and 0 < held["f1"] < 1 and held["correct"] == 1.0
    assert score_squad("Vikings", answers) == {"em": 0.0, "f1": 0.0, "correct": 0.0}
    assert score_squad("Frances", answers)["correct"] == 0.0  # whole words only


def test_rows_run_and_count_correct_answers(make_tiny_engine, tokenizer):
    """Two short SQuAD cases through full prefill and the default blend row on a tiny llama: every record is
    scored with ``correct`` and the summary counts them (the column the second-format check reports)."""
    from semkv.bench.blend import RowSpec, blend_row, run_cases, summarise_all
    from semkv.reuse.options import BlendConfig

    engine = make_tiny_engine("llama")
    workload = squad_workload(tokenizer, "dev", 2, 0, 400)
    specs = [RowSpec("full prefill", "none"), blend_row("query", 0.15, BlendConfig())]
    results = run_cases(engine, workload, workload.cases, specs, 4)
    rows = summarise_all("squad", [s.label for s in specs], results)
    assert [r["n"] for r in rows] == [2, 2]
    for row, label in zip(rows, results, strict=True):
        assert row["correct"] == sum(r["correct"] for r in results[label])
        assert all(r["correct"] in (0.0, 1.0) for r in results[label])
