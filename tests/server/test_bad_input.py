"""Bad input: every injected mistake is a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import pytest

TINY = "tiny"
GOOD = {"model": TINY, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client(module_client_factory):
    """One app for the whole module: every bad input below hits the same server, which must keep serving."""
    return module_client_factory()


# OpenAI's error type of each status the server answers here (pinned: a client branches on it)
ERROR_TYPE = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}


def assert_openai_error(response, status: int, param: str | None = "any", code: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ERROR_TYPE[status]
    if param != "any":
        assert error["param"] == param
    if code != "any":
        assert error["code"] == code
    return error


RAW_BODIES = [
    ("{not json", "invalid_json"),
    ('{"model": "tiny", "prompt": "x",}', "invalid_json"),
    ("[]", "invalid_value"),
    ('"just a string"', "invalid_value"),
    ("", "any"),
    ("null", "any"),
    ('{"model": "tiny", "prompt": "\\ud800", "max_tokens": 1}', "invalid_value"),  # lone surrogate
    ('{"model": "\\udfff", "prompt": "x"}', "invalid_value"),
    ('{"model": "tiny", "prompt": "x", "semkv": {"\\ud800": 1}}', "any"),
]


@pytest.mark.parametrize("raw,code", RAW_BODIES)
def test_malformed_json(client, raw, code):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, code=code)
    assert client.post("/v1/completions", json=GOOD).status_code == 200


WRONG = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 3}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": "s" * 200_000}, "stop"),  # the long-stop attack: 4 stops of 200K characters
    ({"stop": ["s" * 200_000] * 4}, "stop"),
    ({"semkv": {"stop": ["x"]}}, "semkv.stop"),
    ({"seed": 2**70}, "seed"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt.list[str].0"),
    ({"prompt": []}, "prompt"),
    ({"model": None}, "model"),
    ({"echo": True}, "echo"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"semkv": "inline"}, "semkv"),
    ({"semkv": {"documents": "doc-1"}}, "semkv.documents"),
    ({"semkv": {"chunks": [1]}}, "semkv.chunks.0"),
    ({"semkv": {"reuse": "bogus"}}, "semkv"),
    ({"semkv": {"reuse": 3}}, "semkv"),
    ({"semkv": {"store_prompt": "x", "unknown_option": 1}}, "semkv.unknown_option"),
    ({"semkv": {"max_new_tokens": 5}}, "semkv.max_new_tokens"),
    ({"semkv": {"repair_loops": "yes"}}, "semkv.repair_loops"),
    ({"semkv": {"on_token": "print"}}, "semkv.on_token"),
]


@pytest.mark.parametrize("patch,param", WRONG, ids=[str(p) for p, _ in WRONG])
def test_wrong_fields(client, patch, param):
    r = client.post("/v1/completions", json={**GOOD, **patch})
    error = assert_openai_error(r, 400)
    assert error["param"] is not None and error["param"].split(".")[0] == param.split(".")[0], error
    assert client.post("/v1/completions", json=GOOD).status_code == 200


CHAT_WRONG = [
    {"messages": []},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": "Hi"},
    {"max_completion_tokens": -3},
    {"logprobs": True},
]


@pytest.mark.parametrize("patch", CHAT_WRONG, ids=[str(p) for p in CHAT_WRONG])
def test_wrong_chat_fields(client, patch):
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, **patch}), 400)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_prompt_over_the_context(client):
    """The tiny model's context is 2048 tokens: a longer prompt, or one that leaves no room for
    max_tokens, is a 400 context_length_exceeded (streamed too, before any SSE byte)."""
    long = "word " * 2100
    assert_openai_error(
        client.post("/v1/completions", json={**GOOD, "prompt": long}), 400, code="context_length_exceeded"
    )
    fits = "word " * 1900
    assert_openai_error(
        client.post("/v1/completions", json={**GOOD, "prompt": fits, "max_tokens": 500}),
        400,
        code="context_length_exceeded",
    )
    r = client.post("/v1/completions", json={**GOOD, "prompt": long, "stream": True})
    assert_openai_error(r, 400, code="context_length_exceeded")
    chat = {**CHAT, "messages": [{"role": "user", "content": long}]}
    del chat["max_tokens"]
    assert_openai_error(client.post("/v1/chat/completions", json=chat), 400, code="context_length_exceeded")
    chat["messages"] = [{"role": "user", "content": "word " * 2000}]  # default max_tokens shrinks to fit
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= 2048
    assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_text_over_the_character_limit(client):
    """The huge-prompt attack: text that cannot fit in the context, known from its length in characters, is a
    400 context_length_exceeded naming the limit (prompt, chat message, inline chunk; streamed too)."""
    engine = client.app.state.semkv.engine
    over = "w" * (engine.max_prompt_chars + 1)
    cases = [
        ("/v1/completions", {**GOOD, "prompt": over}),
        ("/v1/completions", {**GOOD, "prompt": over, "stream": True}),
        ("/v1/completions", {**GOOD, "prompt": ["Hi", over]}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": over}]}),
        ("/v1/chat/completions", {**CHAT, "semkv": {"chunks": [over]}}),
    ]
    for route, body in cases:
        error = assert_openai_error(client.post(route, json=body), 400, code="context_length_exceeded")
        assert str(engine.max_prompt_chars) in error["message"], error
    assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_unknown_ids_routes_and_methods(client):
    assert_openai_error(
        client.post("/v1/completions", json={**GOOD, "semkv": {"documents": ["doc-" + "1" * 32]}}),
        404,
        param="semkv.documents",
        code="document_not_found",
    )
    assert_openai_error(
        client.post("/v1/completions", json={**GOOD, "semkv": {"documents": ["../../etc/passwd"]}}),
        404,
        code="document_not_found",
    )
    assert_openai_error(client.get("/v1/documents/doc-nope"), 404, code="document_not_found")
    assert_openai_error(client.post("/v1/completions", json={**GOOD, "model": "gpt-4"}), 404, param="model")
    assert_openai_error(client.get("/v1/nothing"), 404, code="not_found")
    assert_openai_error(client.get("/v1/completions"), 405)
    assert_openai_error(client.post("/v1/documents", json={"input": ""}), 400, param="input")
    assert_openai_error(client.post("/v1/documents", json={"input": "word " * 2100}), 400)
    assert client.get("/health").json()["status"] == "ok"


def test_body_over_the_limit(tiny_app):
    from fastapi.testclient import TestClient

    from semkv.server import ServerConfig

    with TestClient(tiny_app(ServerConfig(max_body_bytes=4096))) as c:
        assert_openai_error(c.post("/v1/completions", json={**GOOD, "prompt": "x" * 5000}), 413)
        assert c.post("/v1/completions", json=GOOD).status_code == 200


BAD_BLEND_SELECTORS = [
    ({"selector": "bogus"}, "selector"),
    ({"selector": {"name": "chunk-start", "k": -4}}, "k"),
    ({"selector": {"name": "query", "temperature": 0}}, "temperature"),
    ({"selector": {"name": "query", "temperature": 2.01}}, "temperature"),
    ({"selector": {"name": "deviation", "scale": -1.0}}, "scale"),
    ({"selector": {"name": "deviation", "scale": 5}}, "scale"),
    ({"selector": {"name": "query", "depth": "deep"}}, "depth"),
    ({"selector": {"k": 3}}, "name"),
    ({"recompute_ratio": 1.5}, "recompute_ratio"),
]


@pytest.mark.parametrize("blend,field", BAD_BLEND_SELECTORS, ids=[str(b) for b, _ in BAD_BLEND_SELECTORS])
def test_bad_blend_selector(client, blend, field):
    """A bad blend selector or selector option over HTTP is a 400 whose message names the field."""
    body = {**GOOD, "semkv": {"chunks": ["A short document."], "reuse": "blend", "blend": blend}}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400, param="any")
    assert error["param"].startswith("semkv.blend"), error
    assert field in error["message"], error
    assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_blend_selector_over_http(client):
    """A selector and its options chosen per request reach the blend of an uploaded document (the stats
    echo them)."""
    doc = "The lighthouse keeper counted ships every night and wrote their names in a blue book."
    doc_id = client.post("/v1/documents", json={"input": doc}).json()["data"][0]["id"]
    for number, selector in enumerate(
        ("query", {"name": "chunk-start", "k": 3, "temperature": 0.9, "scale": 0.8})
    ):
        blend = {"recompute_ratio": 0.5, "selector": selector}
        body = {
            **GOOD,
            "prompt": f"What did the keeper count? ({number})",
            "semkv": {"documents": [doc_id], "reuse": "blend", "store_prompt": False, "blend": blend},
        }
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        stats = r.json()["semkv"]
        assert stats["path"] == "blend" and stats["chunk_hits"] == 1 and stats["blend_selected_tokens"] > 0
        expected = selector if isinstance(selector, dict) else {"name": selector}
        assert {k: stats["selector"][k] for k in expected} == expected
