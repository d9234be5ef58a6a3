"""Loop repair re-decodes a looping answer exactly from what the client holds, not from the loop's first copy.

Injected: a blended sequence (tiny llama, fp32, chunks precomputed) whose answer is teacher-forced into
"A (B C D) x 3", a loop whose tokens before and in its first copy ("A B C D") full prefill never writes, as
a blend answer that has left full prefill's path and then loops does; the request does not stream (no
client holds any of it). Must happen: the repair drops the whole answer, recomputes the reused rows exactly
and decoding goes on from the prompt, so the finished answer is full prefill's, token for token. The code
this guards against kept "A B C D" (the answer up to the end of the pattern's first copy): the exact model
then went on from text full prefill never wrote (on the held-out answer that looped, 16 new tokens, it
carried the loop on from that first copy, and a repair happens only once).
"""

from __future__ import annotations

from semkv.reuse.options import BlendConfig
from tests.test_loop_repair import CHUNKS, QUESTION, A, B, C, D, engines, forced

LOOP = [A, B, C, D, B, C, D, B, C, D]


def test_unstreamed_loop_is_redecoded_as_full_prefill(make_tiny_engine, tokenizer):
    blended, exact = engines(make_tiny_engine, tokenizer)
    max_new = 16
    full = exact.generate(
        prompt=QUESTION,
        chunks=CHUNKS,
        max_new_tokens=max_new,
        stop_at_eos=False,
        store_prompt=False,
        reuse="none",
    )
    assert full.token_ids[:4] != [A, B, C, D]  # the forced answer is off full prefill's path
    seq = forced(blended, LOOP, max_new_tokens=max_new, reuse="blend", blend=BlendConfig(0.15, "query"))
    assert not seq.outcome.exact and seq.delivered == 0
    assert blended.repair_loop(seq)
    note = seq.notes["loop_repair"]
    assert (note["kept_tokens"], note["dropped_tokens"]) == (0, len(LOOP))
    assert seq.tokens == full.token_ids[:1]  # the first token from the recomputed prompt: full prefill's
    blended.decode(seq)
    assert seq.output_ids() == full.token_ids
