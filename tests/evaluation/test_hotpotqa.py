"""HotpotQA RAG cases and HotpotQA's answer scoring.

Injected: real HotpotQA dev questions (test split), the SmolLM2 tokenizer. Must happen: a case holds
each of its paragraphs once, rendered identically in every case (so chunk KV can be reused), the
supporting paragraphs at seeded positions; padding brings the prompt to just under the target as the
chat layout counts it; the same seed gives the same cases; the rendered conversation is the layout's
text; EM/F1 match hand-computed values, including HotpotQA's yes/no/noanswer rule; the answer is
extracted from generations as the small models write them (cases from the dev-split runs) and scored.
"""

from __future__ import annotations

from collections import Counter

import pytest

from semkv.evaluation.corpora import hotpot_split
from semkv.evaluation.hotpotqa import (
    RAG_INSTRUCTION,
    RagBuilder,
    RagConfig,
    build_rag_cases,
    extract_answer,
    hotpot_score,
    paragraph_text,
    rag_layout,
)
from semkv.evaluation.metrics import normalize_answer
from semkv.prompt import CHUNK_SEPARATOR


@pytest.fixture(scope="module")
def items():
    return hotpot_split("test")[:40]


def test_a_case_holds_its_paragraphs_once_with_the_gold_ones_at_seeded_positions(items):
    cases = build_rag_cases(items, RagConfig(seed=3))
    for item, case in zip(items, cases, strict=True):
        assert sorted(case.chunks) == sorted({paragraph_text(p) for p in item.paragraphs})
        assert case.padding == 0
        gold_titles = {case.chunks[i].split("\n", 1)[0].removeprefix("Title: ") for i in case.gold}
        assert gold_titles == item.gold_titles
        answer = normalize_answer(item.answer)
        if answer not in ("yes", "no"):
            assert answer in normalize_answer(" ".join(case.chunks[i] for i in case.gold))
    firsts = Counter(case.gold[0] for case in cases)
    assert len(firsts) >= 4  # gold paragraphs are not always in the same slot
    assert [c.chunks for c in build_rag_cases(items, RagConfig(seed=3))] == [c.chunks for c in cases]
    assert [c.chunks for c in build_rag_cases(items, RagConfig(seed=4))] != [c.chunks for c in cases]


@pytest.mark.parametrize("target", [2048, 4096])
def test_padding_reaches_just_under_the_target_as_the_layout_counts_it(items, tokenizer, target):
    cases = build_rag_cases(items[:12], RagConfig(target_tokens=target, seed=0), tokenizer)
    for item, case in zip(items[:12], cases, strict=True):
        layout = rag_layout(tokenizer, case)
        assert case.prompt_tokens == len(layout)
        assert target - 64 <= case.prompt_tokens <= target
        titles = [c.split("\n", 1)[0] for c in case.chunks]
        assert len(titles) == len(set(titles))  # no title twice: padding never repeats a paragraph
        assert {case.chunks[i] for i in case.gold} == {
            paragraph_text(p) for p in item.paragraphs if p.title in item.gold_titles
        }
        assert [s.text for s, _, _ in layout.chunk_spans()] == list(case.chunks)
    # padding comes from a fixed pool, so the same padding paragraph recurs across questions
    shared = Counter(c for case in cases for c in set(case.chunks))
    assert max(shared.values()) >= 2


def test_inline_messages_are_the_layout_text(items):
    case = build_rag_cases(items[:1])[0]
    system, user = case.inline_messages()
    assert system == {"role": "system", "content": RAG_INSTRUCTION}
    assert (
        user["content"] == CHUNK_SEPARATOR.join(case.chunks) + CHUNK_SEPARATOR + f"Question: {case.question}"
    )
    assert case.messages()[-1]["content"] == f"Question: {case.question}"


def test_bad_config_names_the_field(tokenizer):
    with pytest.raises(ValueError, match="target_tokens"):
        RagConfig(target_tokens=0)
    with pytest.raises(ValueError, match="padding_pool"):
        RagConfig(padding_pool=0)
    with pytest.raises(ValueError, match="tokenizer"):
        RagBuilder(RagConfig(target_tokens=2048))


@pytest.mark.parametrize(
    ("prediction", "answer", "em", "f1", "precision", "recall"),
    [
        ("The Eiffel Tower.", "eiffel tower", 1, 1, 1, 1),
        ("Paris France", "Paris", 0, 2 / 3, 0.5, 1),
        ("Yes", "yes", 1, 1, 1, 1),
        ("no", "yes", 0, 0, 0, 0),
        ("yes, he was", "yes", 0, 0, 0, 0),  # gold is yes/no and the prediction is not exactly it
        ("no", "no idea", 0, 0, 0, 0),  # the prediction is a special word that is not the gold
        ("noanswer", "noanswer", 1, 1, 1, 1),
        ("the the", "a", 1, 0, 0, 0),  # both normalise to "": equal, but no tokens in common
        ("John Smith Jr", "John Smith", 0, 0.8, 2 / 3, 1),
    ],
)
def test_hotpot_scores_match_hand_computed_values(prediction, answer, em, f1, precision, recall):
    score = hotpot_score(prediction, answer)
    assert score.em == em
    assert score.f1 == pytest.approx(f1)
    assert score.precision == pytest.approx(precision)
    assert score.recall == pytest.approx(recall)


def test_squad_case_holds_its_paragraph_among_its_articles():
    """A SQuAD case: the question's paragraph at ``gold`` among other paragraphs of its article, seeded."""
    from semkv.evaluation.corpora import squad_articles, squad_split
    from semkv.evaluation.hotpotqa import squad_case

    item = squad_split("test")[0]
    case = squad_case(item, paragraphs=4)
    article = set(squad_articles()[item.article])
    assert len(case.chunks) == min(4, len(article)) and set(case.chunks) <= article
    assert case.chunks[case.gold[0]] == item.context and case.chunks.count(item.context) == 1
    assert case.answer == item.answers[0] and case.answer in item.context
    assert squad_case(item, paragraphs=4) == case and squad_case(item, paragraphs=4, seed=1) != case
    assert squad_case(item, paragraphs=1).chunks == (item.context,)
    with pytest.raises(ValueError, match="paragraphs"):
        squad_case(item, paragraphs=0)


@pytest.mark.parametrize(
    "generation, expected",
    [
        ("The answer is: Nils Gaup.", "Nils Gaup"),  # SmolLM2's usual form
        ("The answer is Ronnie Radke.", "Ronnie Radke"),  # the cue without a colon
        ("The answer to this question is: Mark Pavelich", "Mark Pavelich"),
        ("The answer is:\n\n2012.", "2012"),  # the answer on a later line than its cue
        ("\n\nAnswer: 1989\n\nQuestion: The Black Stallion is", "1989"),  # Gemma 3's usual form
        ("\nAnswer:  Sydney, Australia\n\nQuestion:  No. 1", "Sydney, Australia"),
        ("\nAnswer:\nAnswer:\nAnswer:\n", ""),  # repeated cues, no answer
        ("A: St. Louis, Missouri. It is a city", "St. Louis, Missouri"),  # "St." ends no sentence
        ("answer: U.S. Army. Next", "U.S. Army"),
        ("The answer is: Mrs. Smith", "Mrs. Smith"),
        ("Final Answer: Jan. 5, 1990. Then", "Jan. 5, 1990"),
        ("\nAnswer: Bruce Conner (born 16 May 1961", "Bruce Conner"),  # cut-off parenthetical
        ("Answer: Bruce Conner (born 1933) was a Swedish artist", "Bruce Conner was a Swedish artist"),
        ("1956?\n\nAnswer: The Commission", "1956"),  # a cue not at the start is not searched for
        ("Answering machines record calls.", "Answering machines record calls"),  # not a cue
        ("Title: The Black Stallion (film)\nTitle: x", "Title: The Black Stallion"),
        ("", ""),
    ],
)
def test_extract_answer_takes_the_answer_out_of_a_generation(generation, expected):
    assert extract_answer(generation) == expected


@pytest.mark.parametrize(
    "generation, answer, em, f1",
    [
        ("The answer is: Dave Brockie.", "Dave Brockie", 1, 1),  # raw first line: F1 2/3, EM 0
        ("\nAnswer: Bruce Conner (born 16 May 1961", "Bruce Conner", 1, 1),  # raw: F1 4/9
        ("\nAnswer: Ronnie Radke or Dave Brockie\n\nTitle: x", "Dave Brockie", 0, 4 / 7),  # P 2/5, R 1
        ("The answer is: yes, he was.", "yes", 0, 0),  # HotpotQA's yes/no rule still applies
    ],
)
def test_extracted_answers_score_as_hand_computed(generation, answer, em, f1):
    score = hotpot_score(extract_answer(generation), answer)
    assert (score.em, score.f1) == (em, pytest.approx(f1))
