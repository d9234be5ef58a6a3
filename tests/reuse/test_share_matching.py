"""The vectorised matching (``align_runs``, ``match_same_token``, ``exact_prefix_length``) against the
token-by-token implementation it replaced, kept here as the reference.

Injected: random token sequences over small and large vocabularies, and edited copies of a reference
(substituted, inserted, deleted and moved spans, repeated n-grams, runs off either end). Must hold: the
same ``source``, ``expected`` and same-token matches, token for token, as the old loops.
"""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from semkv.reuse.share import align_runs, exact_prefix_length, match_same_token


# -- the token-by-token implementation (semkv/reuse/share.py before the vectorisation) --------------
def loop_align_runs(new_ids: list[int], ref_ids: list[int], anchor: int = 4) -> tuple[np.ndarray, np.ndarray]:
    n, m = len(new_ids), len(ref_ids)
    anchors: dict[tuple[int, ...], list[int]] = {}
    for j in range(m - anchor + 1):
        anchors.setdefault(tuple(ref_ids[j : j + anchor]), []).append(j)
    source = np.full(n, -1, dtype=np.int64)
    expected = np.zeros(n, dtype=np.int64)
    offset, i = 0, 0
    next_j: int | None = 0
    while i < n:
        expected[i] = i + offset
        if next_j is not None and 0 <= next_j < m and new_ids[i] == ref_ids[next_j]:
            source[i] = next_j
            i, next_j = i + 1, next_j + 1
            continue
        hits = anchors.get(tuple(new_ids[i : i + anchor])) if i + anchor <= n else None
        if hits:
            want = i + offset
            at = bisect.bisect_left(hits, want)
            j = min(hits[max(0, at - 1) : at + 1], key=lambda c: abs(c - want))
            source[i : i + anchor] = np.arange(j, j + anchor)
            expected[i : i + anchor] = np.arange(j, j + anchor)
            offset = j - i
            i, next_j = i + anchor, j + anchor
            continue
        i += 1
        next_j = i + offset
    return source, expected


def loop_match_same_token(
    new_ids: list[int], ref_ids: list[int], source: np.ndarray, expected: np.ndarray
) -> np.ndarray:
    where: dict[int, list[int]] = {}
    for j, t in enumerate(ref_ids):
        where.setdefault(t, []).append(j)
    found = np.zeros(source.size, dtype=bool)
    for i in np.flatnonzero(source < 0):
        hits = where.get(new_ids[i])
        if not hits:
            continue
        want = int(expected[i])
        at = bisect.bisect_left(hits, want)
        source[i] = min(hits[max(0, at - 1) : at + 1], key=lambda c: abs(c - want))
        found[i] = True
    return found


def loop_exact_prefix(new_ids: list[int], ref_ids: list[int]) -> int:
    k = 0
    while k < min(len(new_ids), len(ref_ids)) and new_ids[k] == ref_ids[k]:
        k += 1
    return k


# -- inputs ------------------------------------------------------------------------------------------
def edited(ref: list[int], rng: np.random.Generator, vocab: int, edits: int) -> list[int]:
    """A copy of ``ref`` with ``edits`` random span edits (substitute, insert, delete, move)."""
    out = list(ref)
    for _ in range(edits):
        if not out:
            break
        op = int(rng.integers(4))
        at = int(rng.integers(len(out)))
        span = int(rng.integers(1, 24))
        if op == 0:
            out[at : at + span] = rng.integers(vocab, size=span).tolist()
        elif op == 1:
            out[at:at] = rng.integers(vocab, size=span).tolist()
        elif op == 2:
            del out[at : at + span]
        else:
            piece = out[at : at + span]
            del out[at : at + span]
            to = int(rng.integers(len(out) + 1))
            out[to:to] = piece
    return out


def cases() -> list[tuple[list[int], list[int], int]]:
    rng = np.random.default_rng(0)
    out = []
    for trial in range(60):
        vocab = [3, 8, 50, 49152][trial % 4]  # tiny vocabularies: many repeated n-grams and ties
        m = int(rng.integers(0, 400))
        ref = rng.integers(vocab, size=m).tolist()
        anchor = [1, 2, 4, 7][trial % 4]
        if trial % 3 == 0:
            new = rng.integers(vocab, size=int(rng.integers(0, 400))).tolist()  # unrelated
        else:
            new = edited(ref, rng, vocab, int(rng.integers(0, 12)))
        out.append((new, ref, anchor))
    # a text-like case: a reference repeated twice (every anchor has two candidates)
    base = rng.integers(1000, size=300).tolist()
    out.append((edited(base + base, rng, 1000, 6), base + base, 4))
    out.append(([], [1, 2, 3], 4))
    out.append(([1, 2, 3], [], 4))
    out.append(([5, 5, 5, 5, 5], [5, 5], 2))
    return out


@pytest.mark.parametrize("new,ref,anchor", cases())
def test_vectorised_matching_equals_the_token_loop(new: list[int], ref: list[int], anchor: int) -> None:
    source, expected = align_runs(new, ref, anchor)
    want_source, want_expected = loop_align_runs(new, ref, anchor)
    np.testing.assert_array_equal(source, want_source)
    np.testing.assert_array_equal(expected, want_expected)
    found = match_same_token(new, ref, source, expected)
    want_found = loop_match_same_token(new, ref, want_source, want_expected)
    np.testing.assert_array_equal(found, want_found)
    np.testing.assert_array_equal(source, want_source)
    assert exact_prefix_length(new, ref) == loop_exact_prefix(new, ref)


def test_numpy_ids_match_like_lists() -> None:
    """Token ids given as int64 arrays (what ``match_tokens`` passes on) match as lists do."""
    rng = np.random.default_rng(1)
    ref = rng.integers(100, size=500)
    new = np.asarray(edited(ref.tolist(), rng, 100, 8))
    a = align_runs(new, ref, 4)
    b = align_runs(new.tolist(), ref.tolist(), 4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
