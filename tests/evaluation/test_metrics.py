"""The metrics behind every quality figure, against hand-computed values and the official SQuAD script.

Injected: known answer pairs (SQuAD-style normalisation cases, containment at word boundaries,
windows of long answers), token sequences with a known longest common subsequence, next-token
distributions with a closed-form KL, and paired score lists with a hand-computed Student-t interval.
Must happen: every figure equals the hand-computed value (to float precision); the normalisation
equals the official SQuAD v1.1 evaluation script's (transcribed below) on generated text.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from semkv.evaluation.metrics import (
    answer_f1,
    best_answer_f1,
    degenerate_loop,
    exact_match,
    logit_kl,
    normalize_answer,
    paired_difference,
    paired_speedup,
    rouge_l,
    t_quantile_95,
    top1_agree,
)


# -- the official SQuAD v1.1 evaluation script (evaluate-v1.1.py), transcribed as the reference ------
def squad_normalize_answer(s: str) -> str:
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def squad_f1_score(prediction: str, ground_truth: str) -> float:
    prediction_tokens = squad_normalize_answer(prediction).split()
    ground_truth_tokens = squad_normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


# -- normalisation, F1, exact match ----------------------------------------------------------------
@pytest.mark.parametrize(
    "text, normal",
    [
        ("The Denver Broncos", "denver broncos"),
        ("  an Apple a day, keeps THE doctor away!  ", "apple day keeps doctor away"),
        ("Theatre, then: anthem.", "theatre then anthem"),  # articles only as whole words
        ("9,412 maps (in 2019)", "9412 maps in 2019"),
        ("rock-'n'-roll", "rocknroll"),
        ("A", ""),
        ("", ""),
    ],
)
def test_normalize_answer_known_cases(text, normal):
    assert normalize_answer(text) == normal == squad_normalize_answer(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " \t\n", max_size=60))
def test_normalize_answer_equals_squad(text):
    assert normalize_answer(text) == squad_normalize_answer(text)


@pytest.mark.parametrize(
    "prediction, reference, f1",
    [
        ("Denver Broncos", "The Denver Broncos", 1.0),
        ("the Broncos of Denver", "Denver Broncos", 2 * (2 / 3) * 1.0 / (2 / 3 + 1.0)),  # P 2/3, R 1
        ("Paris", "Paris France", 2 * 1.0 * 0.5 / 1.5),  # P 1, R 1/2
        ("cat cat cat", "cat", 2 * (1 / 3) * 1.0 / (1 / 3 + 1.0)),  # clipped counts: overlap 1
        ("cat cat", "cat cat dog", 2 * 1.0 * (2 / 3) / (1.0 + 2 / 3)),
        ("London", "Paris", 0.0),
    ],
)
def test_answer_f1_known_cases(prediction, reference, f1):
    assert answer_f1(prediction, reference) == pytest.approx(f1, abs=1e-12)
    assert answer_f1(prediction, reference) == pytest.approx(squad_f1_score(prediction, reference), abs=1e-12)


def test_answer_f1_empty_sides():
    """Both empty after normalisation: a match (1.0, where the SQuAD script says 0); one empty: 0."""
    assert answer_f1("the", "a") == 1.0
    assert answer_f1("", "Paris") == 0.0 and answer_f1("Paris", "") == 0.0


def test_best_answer_f1_scores_the_best_window():
    prediction = "It was closed in 1998, after a flood."  # -> it was closed in 1998 after flood
    assert best_answer_f1(prediction, "1998") == 1.0
    # the reference has 2 tokens: windows of 2; the best ("in 1998") has P 1/2, R 1/2
    assert best_answer_f1(prediction, "the year 1998") == pytest.approx(0.5)
    # the plain F1 over the 7 prediction tokens is lower: P 1/7, R 1/2
    assert answer_f1(prediction, "the year 1998") == pytest.approx(2 * (1 / 7) * 0.5 / (1 / 7 + 0.5))
    assert best_answer_f1("Paris", "Paris France") == answer_f1("Paris", "Paris France")  # short: plain F1


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        ("The answer is Paris.", "paris", True),
        ("the Denver Broncos won", "The Denver Broncos", True),
        ("Parisian cafes", "Paris", False),  # only at word boundaries
        ("Broncos Denver", "Denver Broncos", False),  # order matters
        ("pass key: 48213.", "48213", True),
        ("anything", "", False),  # an empty reference never matches
        ("anything", "the", False),  # nor one that normalises to nothing
    ],
)
def test_exact_match_is_containment_at_word_boundaries(prediction, reference, expected):
    assert exact_match(prediction, reference) is expected


# -- ROUGE-L ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        ("the cat sat on the mat", "the cat is on the mat", 100 * 5 / 6),  # LCS 5 of 6 and 6
        ("A B C D", "b d a", 100 * 2 * 0.5 * (2 / 3) / (0.5 + 2 / 3)),  # LCS "b d": P 2/4, R 2/3
        (
            "Police killed the gunman.",
            "the gunman was killed by police",
            100 * 2 * 0.5 * (2 / 6) / (0.5 + 2 / 6),
        ),
        ("same words here", "Same, words; HERE!", 100.0),
        ("nothing", "in common", 0.0),
        ("", "reference", 0.0),
    ],
)
def test_rouge_l_known_cases(prediction, reference, expected):
    assert rouge_l(prediction, reference) == pytest.approx(expected, abs=1e-9)


# -- next-token distributions ---------------------------------------------------------------------------
def test_logit_kl_closed_form_and_direction():
    p = torch.tensor([0.0, math.log(3.0)])  # softmax: [0.25, 0.75]
    q = torch.tensor([0.0, 0.0])  # softmax: [0.5, 0.5]
    kl_pq = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    kl_qp = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert logit_kl(p, q) == pytest.approx(kl_pq, abs=1e-6)  # KL(P_reference || P)
    assert logit_kl(q, p) == pytest.approx(kl_qp, abs=1e-6)
    assert logit_kl(p, p + 7.0) == pytest.approx(0.0, abs=1e-7)  # logits are shift-invariant
    assert logit_kl(p.half(), q.half()) == pytest.approx(kl_pq, abs=1e-3)  # computed in float32


def test_top1_agree():
    assert top1_agree(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([5.0, 9.0, -1.0]))
    assert not top1_agree(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([0.1, 0.2, 0.3]))


# -- paired differences -----------------------------------------------------------------------------------
def test_paired_difference_hand_computed():
    method, baseline = [1, 0, 1, 1], [0, 0, 1, 0]  # differences 1, 0, 0, 1
    d = paired_difference(method, baseline)
    half = 3.182 * math.sqrt((4 * 0.25 / 3) / 4)  # t(3) * sd / sqrt(n), sd^2 = sum (d - 0.5)^2 / (n - 1)
    assert (d.n, d.gained, d.lost) == (4, 2, 0)
    assert d.mean == pytest.approx(0.5)
    assert (d.low, d.high) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    worse = paired_difference([0.2, 0.4, 0.1], [0.5, 0.4, 0.6])  # -0.3, 0, -0.5: mean -4/15
    sd = math.sqrt(((-0.3 + 4 / 15) ** 2 + (4 / 15) ** 2 + (-0.5 + 4 / 15) ** 2) / 2)
    assert worse.mean == pytest.approx(-4 / 15)
    assert worse.high == pytest.approx(-4 / 15 + 4.303 * sd / math.sqrt(3))
    assert (worse.gained, worse.lost) == (0, 2)


def test_paired_speedup_is_the_geometric_mean_of_per_item_ratios():
    """Baseline 4 / 9 / 2 s, method 1 / 3 / 4 s: ratios 4, 3, 0.5 (log ratios 2 ln2, ln3, -ln2)."""
    s = paired_speedup([4.0, 9.0, 2.0], [1.0, 3.0, 4.0])
    logs = [2 * math.log(2), math.log(3), -math.log(2)]
    mean = sum(logs) / 3
    half = 4.303 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2 / 3)
    assert (s.n, s.faster, s.slower) == (3, 2, 1)
    assert s.ratio == pytest.approx(6 ** (1 / 3))  # (4 * 3 * 0.5) ** (1/3)
    assert (s.low, s.high) == (pytest.approx(math.exp(mean - half)), pytest.approx(math.exp(mean + half)))
    with pytest.raises(ValueError, match="times > 0"):
        paired_speedup([1.0, 0.0], [1.0, 1.0])


def test_paired_difference_edge_cases():
    one = paired_difference([0.7], [0.2])
    assert (one.n, one.low, one.high) == (1, pytest.approx(0.5), pytest.approx(0.5))  # no spread to estimate
    same = paired_difference([0.3, 0.3], [0.3, 0.3])
    assert (same.mean, same.low, same.high, same.gained, same.lost) == (0.0, 0.0, 0.0, 0, 0)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1, 2], [1])
    with pytest.raises(ValueError, match="at least one pair"):
        paired_difference([], [])


@pytest.mark.parametrize(
    "dof, quantile, tolerance",
    [(1, 12.706, 0), (2, 4.303, 0), (5, 2.571, 0), (10, 2.228, 0), (20, 2.086, 0), (30, 2.042, 0)]
    + [(40, 2.0211, 0.002), (60, 2.0003, 0.002), (120, 1.9799, 0.002), (10**6, 1.9600, 0.001)],
)
def test_t_quantile_95_against_the_t_table(dof, quantile, tolerance):
    assert t_quantile_95(dof) == pytest.approx(quantile, abs=tolerance or 1e-9)


def test_t_quantile_95_needs_a_degree_of_freedom():
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_95(0)


# -- degenerate loops ----------------------------------------------------------------------------------------
def test_degenerate_loop():
    loop = [5, 9, 7, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12]  # "the island of the island of ..."
    assert degenerate_loop(loop)
    assert not degenerate_loop(list(range(20)))
    assert not degenerate_loop([11, 12, 13, 11, 12, 13, 1, 2, 3, 4, 5, 6, 7, 8])  # twice only
    assert not degenerate_loop([11, 12, 13] * 3 + list(range(100, 110)))  # the loop is before the last 12
    assert degenerate_loop([4, 4, 4, 4, 4])  # one token repeated: the 3-gram (4, 4, 4) three times
    assert not degenerate_loop([])
