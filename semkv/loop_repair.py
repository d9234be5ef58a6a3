"""Loop repair: an answer decoded from inexact reused KV that starts repeating itself is recomputed exactly.

Why. Blend and share reuse KV computed in another context; on our small models a decode step
now and then copies from a row whose reused KV misleads it, and the answer degenerates into a loop that
full prefill never produces: HotpotQA test split, SmolLM2, 4K tokens, ``query`` at ratio 0.15: "Michele
Marie Marie Marie Marie ..." where full prefill answers "Michele Marie Bachmann is ...", and "... of the
International Community of the International Community of ..." (``deviation`` 0.15: "Google for
Education, Google for Education,"); full prefill produced no such loop on the same questions.

What happens. After every decode step of a sequence whose prefill was inexact, the generated tokens are
checked for a repetition (:func:`semkv.repetition.find_repetition`: the answer ends in three or more copies of a pattern
of at most ``MAX_PERIOD`` tokens, spanning at least ``MIN_SPAN`` tokens: a loop as the blend bench counts
one; two copies are often an echo full prefill writes too, "The answer is: 2015 2015"). The first time
one shows up, the sequence is repaired once (:func:`repair`): every token no client has received yet is
dropped (all of them for a request that does not stream), every cache row after the exact prefix is
recomputed in place over the kept tokens (the KV full prefill would have there), and decoding goes on from
the recomputed logits, exactly. If the client already holds the pattern's first copy (or more), the token
that would continue the pattern is excluded from the next sample. A repetition that is forming (tokens
repeating the ones at most ``MAX_PERIOD`` before them) is held back from a streaming client until it
breaks or the answer ends (:meth:`semkv.sequence.Sequence.held_tokens`), so that a streamed loop can be rolled back to its first
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
from typing import TYPE_CHECKING, Any

from torch import Tensor

from semkv.repetition import Repetition, find_repetition

if TYPE_CHECKING:
    from semkv.models.runtime import Runtime
    from semkv.sequence import Sequence

log = logging.getLogger(__name__)


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
