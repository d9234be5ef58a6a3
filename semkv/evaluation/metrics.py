"""Quality measures shared by every suite: answer F1 / exact match, ROUGE-L, logit KL, top-1 agreement."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

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


def degenerate_loop(token_ids: Sequence[int], window: int = 12, n: int = 3, repeats: int = 3) -> bool:
    """The last ``window`` tokens hold some ``n``-gram ``repeats`` or more times (overlaps count): a
    generation stuck in a loop ("the island of the island of the island of")."""
    tail = [int(t) for t in token_ids][-window:]
    counts = Counter(tuple(tail[i : i + n]) for i in range(len(tail) - n + 1))
    return bool(counts) and max(counts.values()) >= repeats


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


@dataclass(frozen=True)
class PairedDifference:
    """Mean of per-item differences (method - baseline) with a two-sided confidence interval.

    n: pairs; mean: mean difference; low / high: the interval (Student t on the paired differences);
    gained / lost: items where the method scored higher / lower than the baseline.
    """

    n: int
    mean: float
    low: float
    high: float
    gained: int
    lost: int


# Two-sided 95% Student t quantiles by degrees of freedom (1..30); above 30 the normal 1.96 is within 2%.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_95(dof: int) -> float:
    """The two-sided 95% quantile of Student's t with ``dof`` degrees of freedom (>= 1)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    return _T95[dof - 1] if dof <= len(_T95) else 1.96 + 2.4 / dof


def paired_difference(method: Sequence[float], baseline: Sequence[float]) -> PairedDifference:
    """Paired difference of two score lists over the same items (same order), with a 95% interval.

    With one pair the interval is the point itself (no spread to estimate)."""
    if len(method) != len(baseline):
        raise ValueError(f"paired scores need equal lengths, got {len(method)} and {len(baseline)}")
    if not method:
        raise ValueError("paired_difference needs at least one pair")
    diffs = [float(m) - float(b) for m, b in zip(method, baseline, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    if n == 1:
        half = 0.0
    else:
        variance = sum((d - mean) ** 2 for d in diffs) / (n - 1)
        half = t_quantile_95(n - 1) * math.sqrt(variance / n)
    return PairedDifference(
        n, mean, mean - half, mean + half, sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    )


@dataclass(frozen=True)
class PairedSpeedup:
    """Geometric mean of per-item speed-ups (baseline time / method time) with a 95% interval.

    n: pairs; ratio: the geometric mean; low / high: the interval (Student t on the per-item log ratios,
    exponentiated); faster / slower: items where the method took less / more time than the baseline.
    Each pair is measured seconds apart, so a slow spell of the machine moves both times of a pair.
    """

    n: int
    ratio: float
    low: float
    high: float
    faster: int
    slower: int


def paired_speedup(baseline_s: Sequence[float], method_s: Sequence[float]) -> PairedSpeedup:
    """Per-item speed-up of the method over the baseline (same items, same order; times > 0 seconds)."""
    if any(not t > 0 for t in (*baseline_s, *method_s)):
        raise ValueError("paired_speedup needs times > 0")
    log_ratio = paired_difference([math.log(t) for t in baseline_s], [math.log(t) for t in method_s])
    return PairedSpeedup(
        log_ratio.n,
        math.exp(log_ratio.mean),
        math.exp(log_ratio.low),
        math.exp(log_ratio.high),
        log_ratio.gained,
        log_ratio.lost,
    )
