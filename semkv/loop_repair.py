"""Loop repair: an answer decoded from inexact reused KV that starts repeating itself is recomputed exactly.

Why. Blend and share reuse KV computed in another context; on our small models a decode step
now and then copies from a row whose reused KV misleads it, and the answer degenerates into a loop that
full prefill never produces: HotpotQA test split, SmolLM2, 4K tokens, ``query`` at ratio 0.15: "Michele
Marie Marie Marie Marie ..." where full prefill answers "Michele Marie Bachmann is ...", and "... of the
International Community of the International Community of ..." (``deviation`` 0.15: "Google for
Education, Google for Education,"); full prefill produced no such loop on the same questions.

What happens. After every decode step of a sequence whose prefill was inexact, the generated tokens are
checked for a repetition (:func:`find_repetition`: the answer ends in three or more copies of a pattern
of at most ``MAX_PERIOD`` tokens, spanning at least ``MIN_SPAN`` tokens: a loop as the blend bench counts
one; two copies are often an echo full prefill writes too, "The answer is: 2015 2015"). The first time
one shows up, the sequence is repaired once (:func:`repair`): every token no client has received yet is
dropped (all of them for a request that does not stream), every cache row after the exact prefix is
recomputed in place over the kept tokens (the KV full prefill would have there), and decoding goes on from
the recomputed logits, exactly. If the client already holds the pattern's first copy (or more), the token
that would continue the pattern is excluded from the next sample. A repetition that is forming (tokens
repeating the ones at most ``MAX_PERIOD`` before them) is held back from a streaming client until it
breaks or the answer ends (:func:`held_tokens`), so that a streamed loop can be rolled back to its first
copy.

Why back to what the client has, not to the pattern's first copy (as first written). The tokens before
the loop came from the same inexact KV as the loop, and are often already off full prefill's path; the
exact model, given them, can carry the loop on from its first copy: a held-out blended answer (16 new
tokens, chat template) ended in a three-token phrase five times over after its repair, where full
prefill names the answer. Rolled back to what the client holds, an answer that was not streamed is
re-decoded from the prompt over exact KV: it is full prefill's answer. Recomputing without any rollback
does not help either: the exact model carries on the repetition it sees ("Marie Marie Marie ...").

Cost: one exact recompute of the reused rows (about a full prefill's time) and the re-decode of the
dropped tokens per repaired answer, added to its decode time (and to the batch step it happens in);
nothing when no repetition shows up. Answers whose
prefill was exact, teacher-forced steps and sparse decodes (whose block summaries would go stale) are
never touched. ``GenerateRequest(repair_loops=False)`` turns it off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:  # semkv.sequence imports this module (held_tokens)
    from semkv.models.runtime import Runtime
    from semkv.sequence import Sequence

log = logging.getLogger(__name__)

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


def held_tokens(seq: Sequence) -> int:
    """Tokens at the end of ``seq``'s answer not to hand to a callback yet (:meth:`Sequence.emit_pending`):
    a repetition forming in an answer loop repair may still roll back (:func:`forming_repetition`); 0 once
    the sequence finished or when it cannot be repaired. Delivered tokens are the client's and are never
    rolled back, so without this a streamed loop (or a server's, whose steps hand every token on) could
    only be repaired from its third copy on."""
    if seq.outcome is None:  # a stand-in without a prefill (the scheduler's tests)
        return 0
    if seq.finished or not wants_repair(seq):
        return 0
    return forming_repetition(seq.tokens)


def wants_repair(seq: Sequence) -> bool:
    """The sequence's answer comes from inexact KV, is decoded densely, asks for repair, has none yet and was
    not ended by EOS or a client. One that just reached ``max_new_tokens`` still qualifies: the rollback
    makes room, and decoding goes on."""
    return (
        seq.request.repair_loops
        and not seq.outcome.exact
        and seq.sparse is None
        and "loop_repair" not in seq.notes
        and not seq.stop_requested
        and not seq.ends_with_eos()
    )


def repair(runtime: Runtime, seq: Sequence) -> bool:
    """Repair ``seq`` if its answer ends in a repetition (see the module docstring); True if it did.

    Kept: the tokens a client has received (``seq.delivered``; none when the request does not stream).
    The cache holds the prompt + ``seq.tokens[:-1]``; afterwards it holds the prompt + the kept tokens,
    every row after ``outcome.info["exact_prefix_rows"]`` (0 if the path gives none) recomputed, and
    ``seq.tokens`` is the kept tokens + one token sampled from the recomputed logits.
    """
    found = find_repetition(seq.tokens)
    if found is None:
        return False
    started = time.perf_counter()
    keep = min(seq.delivered, len(seq.tokens) - 1)  # the last token is not in the cache yet
    banned = seq.tokens[keep - found.period] if keep >= found.onset else None
    cache = seq.cache
    cache.truncate(seq.prompt_tokens + keep)
    # at least the last row is recomputed: its logits give the next token
    exact = min(int(seq.outcome.info.get("exact_prefix_rows", 0)), cache.length - 1)
    logits = recompute_rows(runtime, seq, exact)
    dropped = len(seq.tokens) - keep
    del seq.tokens[keep:]
    seq.emitted = min(seq.emitted, keep)
    if banned is not None:
        logits = logits.clone()
        logits[banned] = float("-inf")
    seq.sample(logits)
    seq.notes["loop_repair"] = record(found, keep, dropped, cache.length - exact, started)
    log.info("repaired a looping answer: %s", seq.notes["loop_repair"])
    return True


def recompute_rows(runtime: Runtime, seq: Sequence, first: int) -> Tensor:
    """Recompute cache rows [first, length) in place, every layer; the last row's logits [V] (float32)."""
    logits = runtime.forward_rows(seq.cache, first)
    assert logits is not None
    return logits.float()


def record(found: Repetition, keep: int, dropped: int, rows: int, started: float) -> dict[str, Any]:
    """What a repair did, for the sequence's stats."""
    return {
        "period": found.period,
        "kept_tokens": keep,
        "dropped_tokens": dropped,
        "recomputed_rows": rows,
        "seconds": round(time.perf_counter() - started, 4),
    }
