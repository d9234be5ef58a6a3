"""Failure mode: one sequence's sparse set-up raises at its first decode step (the policy's preparation,
run since the set-up left the first token), inside a batched decode step.

Injected: as soon as the hostile request (Key-Key, a small budget) is running and its decoder not set up
yet, its decoder's ``attach`` is made to raise. Must happen: the hostile request ends alone with that
error; the innocent request beside it (dense) gets exactly its tokens alone and ends normally. On the code
that set decoders up inside the prefill the injection came too late (the hostile request decoded on).
"""

from __future__ import annotations

from semkv.engine import Engine
from tests.reliability.isolation import HOSTILE, assert_sparse_fault_stays_alone, running_sequence


def broken_set_up(*args, **kwargs):
    raise RuntimeError("injected sparse set-up failure")


def break_hostile_set_up(engine: Engine, step: int) -> None:
    """While the hostile sequence's decoder is not set up: its set-up raises."""
    seq = running_sequence(engine, HOSTILE)
    if seq is not None and seq.sparse is not None and seq.sparse.index is None:
        seq.sparse.attach = broken_set_up


def test_a_raising_sparse_set_up_ends_its_sequence_alone(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    assert_sparse_fault_stays_alone(engine, break_hostile_set_up, "injected sparse set-up failure")
