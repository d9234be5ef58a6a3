"""Failure mode: one sequence's sparse selection raises in the middle of a batched decode (a policy bug,
a fast-tier copy that fails), inside the runtime's batched forward.

Injected: once both requests decode, the hostile request's sparse decoder (Key-Key, a small budget) is
made to raise from its ``gather`` at every layer. Must happen: the hostile request ends alone with that
error; the innocent request beside it (dense) gets exactly its tokens alone and ends normally. On the old
code the exception left the runtime's batched step and the scheduler ended both.
"""

from __future__ import annotations

from semkv.engine import Engine
from tests.reliability.isolation import HOSTILE, assert_sparse_fault_stays_alone, running_sequence


def broken_selection(*args, **kwargs):
    raise RuntimeError("injected sparse selection failure")


def break_hostile_selection(engine: Engine, step: int) -> None:
    """Before step 3: the hostile sequence's sparse decoder raises from then on."""
    seq = running_sequence(engine, HOSTILE)
    if step == 3 and seq is not None:
        assert seq.sparse is not None
        seq.sparse.gather = broken_selection


def test_a_raising_sparse_selection_ends_its_sequence_alone(make_tiny_engine):
    engine = make_tiny_engine("llama", block_size=4)
    assert_sparse_fault_stays_alone(engine, break_hostile_selection, "injected sparse selection failure")
