"""Repeated tails in a token list: the test loop repair runs after each decode step (:mod:`semkv.loop_repair`)
and the count of tokens a streaming client is not handed yet while a repetition forms."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PERIOD = 8  # longest repeated pattern looked for (tokens)
MIN_COPIES = 3  # a loop, as the bench counts one (a 3-gram 3+ times); two copies are an echo ("2015\n\n2015")
MIN_SPAN = 4  # the repeated tail must span at least this many tokens ("Marie" x 4)
MIN_HELD = 1  # a tail repeating this many tokens of an earlier stretch is held back from a streaming client


@dataclass(frozen=True)
class Repetition:
    """A repeated tail: ``period`` tokens long, its second copy starting at ``onset`` (tokens before it are
    the answer up to the end of the pattern's first copy). A repair bans the token that continues the
    pattern when the client already holds the first copy (tokens up to ``onset``) or more."""

    period: int
    onset: int


def find_repetition(
    tokens: list[int], max_period: int = MAX_PERIOD, min_span: int = MIN_SPAN, min_copies: int = MIN_COPIES
) -> Repetition | None:
    """The shortest period p <= ``max_period`` whose last max(min_copies, ceil(min_span / p)) copies make up
    the end of ``tokens``, or None. E.g. [a, b, x, x, x, x] -> period 1, onset 3; [a, b, c, b, c, b, c] ->
    period 2, onset 3; [a, b, c, b, c] -> None (two copies)."""
    for period in range(1, max_period + 1):
        copies = max(min_copies, -(-min_span // period))
        span = copies * period
        if len(tokens) < span:
            break
        tail = tokens[-span:]
        if all(tail[i] == tail[i % period] for i in range(period, span)):
            return Repetition(period, len(tokens) - span + period)
    return None


def forming_repetition(tokens: list[int], max_period: int = MAX_PERIOD, min_held: int = MIN_HELD) -> int:
    """How many tokens at the end of ``tokens`` repeat the ones a period p <= ``max_period`` before them
    (the longest such run over every p), if at least ``min_held``; else 0. E.g. [a, b, c, d, b, c] -> 2
    ("b c" repeat p = 3 back); [a, b, c, d] -> 0."""
    held = 0
    for period in range(1, max_period + 1):
        run = 0
        while run + period < len(tokens) and tokens[-1 - run] == tokens[-1 - run - period]:
            run += 1
        held = max(held, run)
    return held if held >= min_held else 0
