"""A 500 never tells the client what went wrong inside.

Injected: failures whose exception text holds what must not leave the server (a file path under the
home, a key, another request's prompt) — raised by the engine's prefill step before the first token
(plain and streamed), by its batched decode step after some tokens of a stream, and by a route outside
the engine (the document registry).

Must hold: the client gets a 500 (or, mid-stream, an SSE error event) in OpenAI's shape whose message
is generic and carries an error id, never the exception's text or type; the server log has the id
and the text; a 400 still explains the client's mistake.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from fastapi.testclient import TestClient

TINY = "tiny"
SECRET = "/home/alice/.cache/semkv/store/ab/abcdef.skv sk-live-0123 'the merger closes Monday'"


@pytest.fixture
def app_and_client(tiny_app):
    app = tiny_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client


def raising(exc: Exception):
    def broken(*args, **kwargs):
        raise exc

    return broken


def check_generic(error: dict, caplog) -> None:
    assert SECRET not in json.dumps(error) and "RuntimeError" not in error["message"], error
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    error_id = re.search(r"error id ([0-9a-f]{12})", error["message"]).group(1)
    assert any(error_id in r.getMessage() and SECRET in r.getMessage() for r in caplog.records)


def test_engine_failure_before_the_first_token(app_and_client, monkeypatch, caplog):
    app, client = app_and_client
    monkeypatch.setattr(app.state.semkv.engine, "begin_prefill", raising(RuntimeError(SECRET)))
    caplog.set_level(logging.ERROR)
    for body in ({"model": TINY, "prompt": "Hi"}, {"model": TINY, "prompt": "Hi", "stream": True}):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500
        check_generic(r.json()["error"], caplog)
    chat = client.post(
        "/v1/chat/completions", json={"model": TINY, "messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 500 and SECRET not in chat.text


def test_engine_failure_in_the_middle_of_a_stream(app_and_client, monkeypatch, caplog):
    app, client = app_and_client
    engine = app.state.semkv.engine
    real = engine.decode_batch
    calls = []

    def fails_later(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError(SECRET)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "decode_batch", fails_later)
    caplog.set_level(logging.ERROR)
    body = {"model": TINY, "prompt": "Hi", "max_tokens": 8, "stream": True, "semkv": {"stop_at_eos": False}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and SECRET not in r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    check_generic(events[-1]["error"], caplog)


def test_route_failure_outside_the_engine(app_and_client, monkeypatch, caplog):
    app, client = app_and_client
    monkeypatch.setattr(app.state.semkv.documents, "list", raising(OSError(SECRET)))
    caplog.set_level(logging.ERROR)
    r = client.get("/v1/documents")
    assert r.status_code == 500
    check_generic(r.json()["error"], caplog)
    bad = client.post("/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": -1})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
