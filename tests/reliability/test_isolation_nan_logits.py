"""Failure mode: one sequence's logits turn NaN in the middle of a batched decode (its KV cache holds NaN:
a corrupted row, a kernel fault).

Injected: once both requests decode, the hostile sequence's cached values of its prompt rows (layer 0)
are set to NaN, so every later step gives it NaN logits (rows of a batched step do not mix: the other
row stays finite). Must happen: the hostile request ends alone with an error naming the NaN logits; the
innocent request beside it gets exactly its tokens alone and ends normally. On the old code sampling
NaN raised inside the batched step and the scheduler ended both.
"""

from __future__ import annotations

from semkv.engine import Engine
from tests.reliability.isolation import (
    HOSTILE,
    INNOCENT,
    INNOCENT_REQUEST,
    alone,
    assert_unharmed,
    hostile_request,
    run_together,
    running_sequence,
)


def poison_values(engine: Engine, step: int) -> None:
    """Before step 3: NaN into the hostile sequence's layer-0 values of its prompt rows."""
    seq = running_sequence(engine, HOSTILE)
    if step == 3 and seq is not None:
        seq.cache.v[0][:, : seq.prompt_tokens] = float("nan")


def test_nan_logits_end_their_sequence_alone(make_tiny_engine):
    engine = make_tiny_engine("llama")
    hostile = hostile_request()
    solo = alone(engine)

    outcomes = run_together(engine, {INNOCENT: INNOCENT_REQUEST, HOSTILE: hostile}, poison_values)

    assert_unharmed(outcomes[INNOCENT], solo)
    assert outcomes[HOSTILE].finish_reason == "error"
    assert "logits contain NaN" in str(outcomes[HOSTILE].error)
