"""Quality measures shared by every suite: answer F1 / exact match, ROUGE-L, logit KL, top-1 agreement."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch
from torch import Tensor

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def answer_f1(prediction: str, reference: str) -> float:
    """Token-level F1 between normalised prediction and reference."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_answer_f1(prediction: str, reference: str) -> float:
    """F1 of the reference against the best-matching window of the prediction (long answers are not
    punished for surrounding words beyond the reference's length)."""
    pred = normalize_answer(prediction).split()
    ref_len = len(normalize_answer(reference).split())
    if len(pred) <= ref_len:
        return answer_f1(prediction, reference)
    return max(answer_f1(" ".join(pred[i : i + ref_len]), reference) for i in range(len(pred) - ref_len + 1))


def exact_match(prediction: str, reference: str) -> bool:
    """The normalised reference occurs in the normalised prediction."""
    ref = normalize_answer(reference)
    return bool(ref) and f" {ref} " in f" {normalize_answer(prediction)} "


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (x100) over lower-cased word tokens."""
    pred = re.findall(r"\w+", prediction.lower())
    ref = re.findall(r"\w+", reference.lower())
    lcs = _lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 100.0 * 2 * precision * recall / (precision + recall)


def logit_kl(reference_logits: Tensor, logits: Tensor) -> float:
    """KL(P_ref || P) of the next-token distributions (nats). Both [V]."""
    log_p = torch.log_softmax(reference_logits.float(), dim=-1)
    log_q = torch.log_softmax(logits.float(), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum())


def top1_agree(reference_logits: Tensor, logits: Tensor) -> bool:
    return int(reference_logits.argmax()) == int(logits.argmax())
