"""The server builds one engine request per generation, tokenizes its prompt once and resolves its options once.

Injected: counters on the tokenizer (every encode of the request's text, on any copy of the tokenizer),
on :class:`~semkv.request.GenerateRequest` construction (those carrying the request's text) and on
:meth:`EngineDefaults.reuse_options`. Must hold, for a chat completion that leaves ``max_tokens`` to the
server (fitted to the context), a completion with ``max_tokens``, and a streamed one: 1 request built,
1 encode, 1 option resolution. The old server built the request twice (validation, then with ``stop``),
tokenized the prompt three times (to fit ``max_tokens``, at admission, at prefill) and resolved options
three times.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import semkv.request as request_module
from semkv.profile import EngineDefaults

TINY = "tiny"
TEXT = "Count me: the one user text whose tokenizations are counted, about a lighthouse keeper."


class Counts:
    def __init__(self) -> None:
        self.built = 0
        self.encodes = 0
        self.options = 0


@pytest.fixture
def counted(monkeypatch, tokenizer) -> Counts:
    found = Counts()
    tokenizer_class = type(tokenizer)
    encode = tokenizer_class.__call__
    post_init = request_module.GenerateRequest.__post_init__
    reuse_options = EngineDefaults.reuse_options

    def counting_encode(self, text, *args, **kwargs):
        if text == TEXT:
            found.encodes += 1
        return encode(self, text, *args, **kwargs)

    def counting_post_init(self):
        carries = self.prompt == TEXT or any(m.get("content") == TEXT for m in self.messages or ())
        found.built += carries
        post_init(self)

    def counting_options(self, request):
        found.options += 1
        return reuse_options(self, request)

    monkeypatch.setattr(tokenizer_class, "__call__", counting_encode)
    monkeypatch.setattr(request_module.GenerateRequest, "__post_init__", counting_post_init)
    monkeypatch.setattr(EngineDefaults, "reuse_options", counting_options)
    return found


REQUESTS = {
    "chat, max_tokens left to the server": (
        "/v1/chat/completions",
        {"model": TINY, "messages": [{"role": "user", "content": TEXT}], "stop": ["zzz"]},
    ),
    "completion": ("/v1/completions", {"model": TINY, "prompt": TEXT, "max_tokens": 3}),
    "streamed completion": (
        "/v1/completions",
        {"model": TINY, "prompt": TEXT, "max_tokens": 3, "stream": True},
    ),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_one_request_one_tokenization_one_resolution(tiny_app, counted, name):
    route, body = REQUESTS[name]
    with TestClient(tiny_app(), raise_server_exceptions=False) as client:
        built_before = counted.built  # the app's start-up (warm-up, config checks) is not the request
        response = client.post(route, json=body)
        assert response.status_code == 200, response.text
    assert counted.built - built_before == 1, vars(counted)
    assert (counted.encodes, counted.options) == (1, 1), vars(counted)
