"""Loop repair (``semkv/loop_repair.py``): a blend answer that starts repeating itself.

Injected: a blended sequence (tiny llama, fp32, chunks precomputed) whose answer is teacher-forced into a
repetition; the same sequence with the repetition partly streamed; an exact (full prefill) sequence, a
request with ``repair_loops=False`` and a sparse decode with the same repetition. Must happen: the blended
one is rolled back to what the client holds (nothing when it does not stream), its rows after the exact
prefix hold the KV full prefill computes for the kept tokens, and its next token is full prefill's; streamed tokens are never dropped and
the token that would continue the pattern is not sampled again; the others are left alone; a repair
happens once. The real loop (SmolLM2, a HotpotQA test question whose blend answer loops) is in
``test_real_loop_is_repaired``.
"""

from __future__ import annotations

import pytest
import torch

from semkv.repetition import Repetition, find_repetition, forming_repetition
from semkv.request import GenerateRequest
from semkv.reuse.options import BlendConfig
from tests.conftest import require_embedded, tiny_hf_model

CHUNKS = [
    "The harbour of Varna holds forty fishing boats; most of them leave before dawn and return at noon.",
    "Mira Olsen repairs nets in the old shed by the pier. She has done so for thirty-one years.",
    "The lighthouse keeper, Ivo, lights the lamp at six and writes the weather in a green book.",
]
QUESTION = "Who repairs the nets, and where?"
A, B, C, D = 1000, 1001, 1002, 1003


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([A, B, C, C, C, C], Repetition(1, 3)),
        ([A, B, C, D, B, C, D, B, C, D], Repetition(3, 4)),
        ([A, B, C, B, C, B, C], Repetition(2, 3)),
        ([A, B, C, D, B, C, D], None),  # two copies: an echo, not a loop
        ([A, B, A], None),
        ([A, C, C, C], None),  # period 1 needs 4 copies
        ([A, B, C, A, B, D], None),
        ([], None),
    ],
)
def test_find_repetition(tokens, expected):
    assert find_repetition(tokens) == expected


@pytest.mark.parametrize(
    ("tokens", "held"),
    [
        ([A, B, C, D], 0),
        ([A, B, C, D, B], 1),  # B repeats the token 3 back: a second copy may be starting
        ([A, B, C, D, B, C], 2),
        ([A, B, C, D, B, C, D, B], 4),  # all after the first copy "B C D"
        ([A, C, C], 1),
        ([], 0),
    ],
)
def test_forming_repetition(tokens, held):
    assert forming_repetition(tokens) == held


def test_find_repetition_period_bound():
    pattern = list(range(2000, 2009))  # 9 tokens: longer than MAX_PERIOD
    assert find_repetition([A] + pattern * 3) is None
    assert find_repetition([A] + pattern * 3, max_period=9) == Repetition(9, 10)
    assert find_repetition([A] + pattern * 2, max_period=9, min_copies=2) == Repetition(9, 10)


def engines(make_tiny_engine, tokenizer):
    """Two tiny llamas with the same weights (wide enough that the output depends on the KV)."""
    model = tiny_hf_model("llama", len(tokenizer), initializer_range=0.1)
    blended, exact = make_tiny_engine("llama", hf_model=model), make_tiny_engine("llama", hf_model=model)
    blended.add_chunks(CHUNKS, BlendConfig())
    return blended, exact


def forced(engine, feed: list[int], max_new_tokens: int = 32, **options):
    """A sequence whose answer is ``feed`` (teacher-forced; the last one not yet in the cache)."""
    request = GenerateRequest(
        prompt=QUESTION,
        chunks=CHUNKS,
        max_new_tokens=max_new_tokens,
        stop_at_eos=False,
        store_prompt=False,
        **options,
    )
    seq = engine.prefill(request)
    for token in feed[:-1]:
        seq.tokens[-1] = token
        engine.decode_step(seq, feed=token)
    seq.tokens[-1] = feed[-1]
    return seq


def test_blend_repetition_rolls_back_to_exact_kv(make_tiny_engine, tokenizer):
    """Not streamed: nothing is kept; the prompt's KV and the next token equal full prefill's."""
    blended, exact = engines(make_tiny_engine, tokenizer)
    answer = [A, B, C, D, B, C, D, B, C, D]  # "A (B C D) x 3"
    seq = forced(blended, answer, reuse="blend", blend=BlendConfig(0.15, "query"))
    assert not seq.outcome.exact
    assert blended.repair_loop(seq)
    reference = exact.prefill(
        GenerateRequest(prompt=QUESTION, chunks=CHUNKS, max_new_tokens=32, store_prompt=False, reuse="none")
    )
    assert seq.tokens == [int(torch.argmax(reference.first_logits))]
    assert seq.cache.length == reference.cache.length  # the prompt
    for layer in range(seq.cache.num_layers):
        torch.testing.assert_close(
            seq.cache.keys(layer), reference.cache.keys(layer)[:, : seq.cache.length], atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            seq.cache.values(layer),
            reference.cache.values(layer)[:, : seq.cache.length],
            atol=1e-4,
            rtol=1e-4,
        )
    note = seq.notes["loop_repair"]
    assert (note["period"], note["kept_tokens"], note["dropped_tokens"]) == (3, 0, 10)
    assert not blended.repair_loop(forced_again := seq) and forced_again.notes["loop_repair"] == note  # once


def test_streamed_tokens_are_kept_and_the_pattern_not_continued(make_tiny_engine, tokenizer):
    """A client streams "A (B C D) x 3" as it is decoded: the forming repetition (the second and third copies)
    is held back, so the client holds "A B C D" when the third copy completes; the repair keeps exactly
    that, and the next token is full prefill's choice with B excluded (B would start a second copy). On
    this tiny model full prefill would not pick B there anyway, so what this checks is the hold, the
    rollback and the exact logits, not the exclusion itself."""
    blended, exact = engines(make_tiny_engine, tokenizer)
    seq = forced(blended, [A], reuse="blend", blend=BlendConfig(0.15, "query"))
    received: list[int] = []
    seq.emit_pending(received.append)
    for token in [B, C, D, B, C, D, B, C]:
        blended.decode_step(seq, feed=seq.tokens[-1])
        seq.tokens[-1] = token
        seq.emit_pending(received.append)
    blended.decode_step(seq, feed=seq.tokens[-1])
    seq.tokens[-1] = D  # the third copy completes: "sampled"
    assert received == [A, B, C, D] == seq.tokens[: seq.delivered]
    assert blended.repair_loop(seq)
    assert seq.tokens[:4] == [A, B, C, D] and len(seq.tokens) == 5
    reference = forced(exact, [A, B, C, D], reuse="none")
    logits = (
        exact.runtime.decode(reference.cache, D, None).float().clone()
    )  # full prefill's next-token logits
    logits[B] = float("-inf")
    assert seq.tokens[4] == int(torch.argmax(logits)) != B  # from the exact KV, B excluded
    assert seq.notes["loop_repair"]["dropped_tokens"] == 6
    seq.emit_pending(received.append)
    assert received == seq.tokens  # the client's stream is the answer


def test_repetition_at_the_token_limit_is_repaired_and_decoding_goes_on(make_tiny_engine, tokenizer):
    """The loop fills the answer up to max_new_tokens: the rollback makes room and the answer is decoded on
    to its full length from the exact KV."""
    blended, _ = engines(make_tiny_engine, tokenizer)
    answer = [A, B, C, D, B, C, D, B, C, D]
    seq = forced(blended, answer, max_new_tokens=len(answer), reuse="blend", blend=BlendConfig(0.15, "query"))
    assert seq.finished
    assert blended.repair_loop(seq) and not seq.finished and len(seq.tokens) == 1
    blended.decode(seq)
    assert len(seq.tokens) == len(answer) and seq.tokens[:4] != [A, B, C, D]


@pytest.mark.parametrize(
    "options",
    [
        dict(reuse="none"),
        dict(reuse="blend", repair_loops=False),
        dict(reuse="blend", sparse="keykey", kv_budget=0.5),
    ],
    ids=["exact-prefill", "repair-off", "sparse"],
)
def test_left_alone(make_tiny_engine, tokenizer, options):
    blended, _ = engines(make_tiny_engine, tokenizer)
    seq = forced(blended, [A, B, C, D, B, C, D, B, C, D], **options)
    tokens, rows = list(seq.tokens), seq.cache.length
    assert not blended.repair_loop(seq)
    assert seq.tokens == tokens and seq.cache.length == rows and "loop_repair" not in seq.notes


def test_bad_input():
    with pytest.raises(ValueError, match="repair_loops"):
        GenerateRequest(prompt="x", repair_loops="yes")


@pytest.mark.slow
def test_real_loop_is_repaired(make_smol_engine):
    """SmolLM2, HotpotQA test position 40 (~4K tokens): blend ``query`` at 0.15 once answered "Michele Marie
    Marie Marie ..." there (full prefill: "Michele Marie Bachmann ..."); whether it still does depends on
    the numerics of the day, so the loop is teacher-forced into the blended answer. With repair on, the
    finished answer is full prefill's."""
    require_embedded("smollm2-135m")
    from semkv.bench.blend import hotpot_workload

    engine = make_smol_engine(kv_dtype="float16", compute_dtype="auto", memory_bytes=1 << 30)
    case = hotpot_workload(engine.tokenizer, "test", 1, 40, 4096, 0).cases[0]
    engine.add_chunks(case.chunks, BlendConfig())
    ask = dict(messages=case.messages, chunks=case.chunks, max_new_tokens=20, store_prompt=False)
    full = engine.generate(reuse="none", **ask)
    seq = engine.prefill(GenerateRequest(reuse="blend", blend=BlendConfig(0.15, "query"), **ask))
    loop = engine.tokenizer("Michele Marie Marie Marie Marie", add_special_tokens=False)["input_ids"]
    for token in loop[:-1]:
        engine.decode_step(seq, feed=token)
    seq.tokens[-1] = loop[-1]
    assert engine.repair_loop(seq) and seq.notes["loop_repair"]["period"] == 1
    engine.decode(seq)
    assert engine.tokenizer.decode(seq.output_ids(), skip_special_tokens=True) == full.text
