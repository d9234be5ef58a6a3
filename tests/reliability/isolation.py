"""Helpers of the one-sequence-fails-alone tests (``test_isolation_*.py``): a hostile and an innocent request
decoded in the same scheduler steps of one engine, against the innocent one decoded alone.

A plain module (``conftest`` is the root's name). Engines are tiny random-weight llamas in float32: a
batched step gives each row the logits of a one-sequence step (``tests/test_engine_batching.py``), so the
innocent request's tokens beside the hostile one must equal its tokens alone, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from semkv.engine import Engine
from semkv.request import GenerateRequest
from semkv.scheduler import StepOutput
from semkv.sequence import Sequence

INNOCENT = "innocent"
HOSTILE = "hostile"

INNOCENT_REQUEST = GenerateRequest(
    prompt="Tell me about the harbour, the boats and the fishermen who sail at dawn.",
    max_new_tokens=12,
    stop_at_eos=False,
    store_prompt=False,
    reuse="none",
    sparse=None,
)
HOSTILE_PROMPT = "Write a long story about a dragon."
# a prompt of enough 4-token blocks for a sparse hostile request to select among
SPARSE_PROMPT = " ".join(f"word{i} is number {i * 7 % 13}." for i in range(40))


def hostile_request(**changes: Any) -> GenerateRequest:
    """The hostile request of a test: :data:`HOSTILE_PROMPT`, 30 tokens past any EOS, dense, nothing reused
    or stored; ``changes`` override fields (e.g. a sampling setting, a stop string)."""
    base = dict(
        prompt=HOSTILE_PROMPT,
        max_new_tokens=30,
        stop_at_eos=False,
        store_prompt=False,
        reuse="none",
        sparse=None,
    )
    return GenerateRequest(**{**base, **changes})


Injection = Callable[[Engine, int], None]  # called before each step with the step's index


@dataclass
class Outcome:
    """What one request got from the scheduler: its tokens, how it ended, its error."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None


def running_sequence(engine: Engine, request_id: str) -> Sequence | None:
    """The live sequence of a decoding request (None while it waits or prefills)."""
    for entry in engine.scheduler.running:
        if entry.request_id == request_id:
            return entry.seq
    return None


def run_together(
    engine: Engine,
    requests: dict[str, GenerateRequest],
    inject: Injection | None = None,
    max_steps: int = 200,
) -> dict[str, Outcome]:
    """Queue every request at once and step the engine until all have ended; ``inject`` runs before
    each step. Returns each request's outcome by id."""
    outcomes = {request_id: Outcome() for request_id in requests}
    for request_id, request in requests.items():
        engine.add_request(request, request_id=request_id)
    for step in range(max_steps):
        if not engine.has_unfinished():
            break
        if inject is not None:
            inject(engine, step)
        for output in engine.step():
            record(outcomes[output.request_id], output)
    assert not engine.has_unfinished(), f"requests still running after {max_steps} steps"
    return outcomes


def record(outcome: Outcome, output: StepOutput) -> None:
    outcome.token_ids += output.token_ids
    if output.finished:
        outcome.finish_reason = output.finish_reason
        outcome.error = output.error


def alone(engine: Engine, request: GenerateRequest = INNOCENT_REQUEST) -> Outcome:
    """The request decoded by itself through the scheduler."""
    return run_together(engine, {INNOCENT: request})[INNOCENT]


def assert_unharmed(together: Outcome, solo: Outcome) -> None:
    """The innocent request ended normally with the tokens it gets alone."""
    assert together.error is None, f"the innocent request failed: {together.error!r}"
    assert together.finish_reason == solo.finish_reason == "length"
    assert together.token_ids == solo.token_ids
    assert len(solo.token_ids) == INNOCENT_REQUEST.max_new_tokens


def assert_sparse_fault_stays_alone(engine: Engine, inject: Injection, message: str) -> None:
    """A hostile Key-Key request (a small budget, :data:`SPARSE_PROMPT`) decodes beside the dense innocent one
    while ``inject`` breaks its sparse decoder: it ends alone with an error naming ``message``, and the
    innocent request gets exactly its tokens alone."""
    hostile = hostile_request(prompt=SPARSE_PROMPT, sparse="keykey", kv_budget=0.2)
    solo = alone(engine)
    outcomes = run_together(engine, {INNOCENT: INNOCENT_REQUEST, HOSTILE: hostile}, inject)
    assert_unharmed(outcomes[INNOCENT], solo)
    assert outcomes[HOSTILE].finish_reason == "error"
    assert message in str(outcomes[HOSTILE].error)
