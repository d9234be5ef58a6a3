"""Failure mode: one request's stop check raises in the middle of a batched decode (its detokenizer hits
a token it cannot decode, a bug in the stop-string search).

Injected: the engine's text streams are wrapped so that the hostile request's stream raises on its 4th
token (the innocent one's stream is the real one). Must happen: the hostile request ends alone with that
error; the innocent request beside it gets exactly its tokens alone and ends normally. On the old code
the exception left the scheduler's step, so the engine step itself raised (a server ended every request).
"""

from __future__ import annotations

from semkv.engine import Engine
from semkv.request import GenerateRequest, ResolvedRequest
from semkv.text_stream import TextStream
from tests.reliability.isolation import (
    HOSTILE,
    HOSTILE_PROMPT,
    INNOCENT,
    INNOCENT_REQUEST,
    alone,
    assert_unharmed,
    hostile_request,
    run_together,
)

FAILING_TOKEN = 4


class FailingStopCheck(TextStream):
    """A real text stream whose stop check raises on its ``FAILING_TOKEN``-th token."""

    pushed = 0

    def push(self, token_id: int) -> str:
        self.pushed += 1
        if self.pushed == FAILING_TOKEN:
            raise RuntimeError("injected stop-check failure")
        return super().push(token_id)


def hostile_streams_fail(engine: Engine, monkeypatch) -> None:
    """Give requests with the hostile prompt a :class:`FailingStopCheck`."""
    real = engine.text_stream

    def text_stream(request: GenerateRequest | ResolvedRequest) -> TextStream:
        given = request.request if isinstance(request, ResolvedRequest) else request
        if given.prompt == HOSTILE_PROMPT:
            return FailingStopCheck(engine.tokenizer, request.stop)
        return real(request)

    monkeypatch.setattr(engine, "text_stream", text_stream)


def test_a_raising_stop_check_ends_its_request_alone(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine("llama")
    hostile = hostile_request(stop=["never appears"])
    solo = alone(engine)
    hostile_streams_fail(engine, monkeypatch)

    outcomes = run_together(engine, {INNOCENT: INNOCENT_REQUEST, HOSTILE: hostile})

    assert_unharmed(outcomes[INNOCENT], solo)
    assert outcomes[HOSTILE].finish_reason == "error"
    assert "injected stop-check failure" in str(outcomes[HOSTILE].error)
    assert len(outcomes[HOSTILE].token_ids) == FAILING_TOKEN - 1
