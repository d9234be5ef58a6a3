"""The OpenAI-compatible routes over a tiny engine, called raw and through the official ``openai`` client."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig

TINY = "tiny"  # the served model name of the tiny_app fixture


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_health_metrics(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == TINY
    assert client.get(f"/v1/models/{TINY}").json()["id"] == TINY
    assert client.get("/v1/models/other").status_code == 404
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["redis"] == "disabled"
    text = client.get("/metrics").text
    assert 'semkv_requests_total{endpoint="/health",status="200"} 1.0' in text
    assert 'semkv_store_tier_hits_total{tier="memory"}' in text and "semkv_store_tier_bytes" in text


def test_completion_and_chat_shapes(client):
    r = client.post("/v1/completions", json={"model": TINY, "prompt": "Hello there", "max_tokens": 4})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    assert (
        body["semkv"]["path"] == "full"
        and body["semkv"]["recomputed_tokens"] == body["usage"]["prompt_tokens"]
    )
    r = client.post(
        "/v1/completions", json={"model": TINY, "prompt": ["one", "two"], "max_tokens": 2, "temperature": 0}
    )
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"model": TINY, "messages": messages, "max_tokens": 3})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["completion_tokens"] == 3


def test_stream_equals_whole_response(client):
    """The concatenated SSE deltas are the non-streamed text, and the last chunk carries the stats."""
    for route, payload, field in [
        ("/v1/completions", {"prompt": "Tell me a story"}, "text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}]}, "delta"),
    ]:
        request = {"model": TINY, "max_tokens": 12, **payload, "semkv": {"reuse": "none"}}
        whole = client.post(route, json=request).json()
        with client.stream(
            "POST", route, json={**request, "stream": True, "stream_options": {"include_usage": True}}
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        if field == "text":
            streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            expected = whole["choices"][0]["text"]
        else:
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            expected = whole["choices"][0]["message"]["content"]
        assert streamed == expected and expected
        final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(final) == 1 and final[0]["semkv"]["generated_tokens"] == 12
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_stop_sequence_ends_generation(client):
    """A stop sequence taken from the free-running output truncates the text there and stops decoding."""
    request = {"model": TINY, "prompt": "Count with me", "max_tokens": 16}
    free = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), free
    r = client.post("/v1/completions", json={**request, "stop": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == free[: free.index(stop)]
    assert r["usage"]["completion_tokens"] < 16


def test_inline_chunks_and_documents(client):
    """Context passed inline or by document id gives the same prompt; unknown ids are a 404."""
    doc = "Tiny models generate random words about many topics and nothing else."
    r = client.post("/v1/documents", json={"input": doc})
    assert r.status_code == 200
    meta = r.json()["data"][0]
    assert meta["id"].startswith("doc-") and meta["tokens"] > 5
    assert client.get(f"/v1/documents/{meta['id']}").json()["text"] == doc
    assert meta["id"] in [d["id"] for d in client.get("/v1/documents").json()["data"]]
    again = client.post("/v1/documents", json={"input": [doc]}).json()["data"][0]
    assert again["id"] == meta["id"]  # content-addressed
    base = {"model": TINY, "prompt": "What is it about?", "max_tokens": 4}
    by_id = client.post(
        "/v1/completions", json={**base, "semkv": {"documents": [meta["id"]], "reuse": "none"}}
    )
    inline = client.post("/v1/completions", json={**base, "semkv": {"chunks": [doc], "reuse": "none"}})
    plain = client.post("/v1/completions", json={**base, "semkv": {"reuse": "none"}})
    assert by_id.json()["usage"] == inline.json()["usage"]
    assert by_id.json()["choices"][0]["text"] == inline.json()["choices"][0]["text"]
    assert (
        by_id.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"] + meta["tokens"] - 1
    )
    missing = client.post("/v1/completions", json={**base, "semkv": {"documents": ["doc-" + "0" * 32]}})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "document_not_found"


def test_prefix_reuse_visible_in_stats_and_metrics(client):
    """The second identical request reuses the first's prefix blocks; /metrics counts it under its path."""
    request = {"model": TINY, "prompt": "A long shared system prompt " * 8, "max_tokens": 2}
    first = client.post("/v1/completions", json=request).json()["semkv"]
    second = client.post("/v1/completions", json=request).json()["semkv"]
    assert first["reused_tokens"] == 0 and second["reused_tokens"] > 0 and second["path"] != "full"
    text = client.get("/metrics").text
    line = next(
        x for x in text.splitlines() if x.startswith(f'semkv_tokens_reused_total{{path="{second["path"]}"}}')
    )
    assert float(line.split()[-1]) == second["reused_tokens"]


def test_server_defaults_and_overrides(tiny_app):
    """Server-wide engine defaults apply unless the request's semkv field overrides them; bad defaults fail."""
    app = tiny_app(ServerConfig(defaults={"reuse": "none"}, debug_stats=True))
    with TestClient(app) as c:
        request = {"model": TINY, "prompt": "A long shared system prompt " * 8, "max_tokens": 2}
        c.post("/v1/completions", json=request)
        assert c.post("/v1/completions", json=request).json()["semkv"]["path"] == "full"
        override = {**request, "semkv": {"reuse": "prefix"}}
        assert c.post("/v1/completions", json=override).json()["semkv"]["path"] == "prefix"
    with pytest.raises(ValueError, match="invalid server defaults: unknown reuse mode 'bogus'"):
        ServerConfig(defaults={"reuse": "bogus"})
    with pytest.raises(ValueError, match=r"server defaults cannot set \['max_new_tokens'\]"):
        ServerConfig(defaults={"max_new_tokens": 3})
    with pytest.raises(ValueError, match="unknown engine options"):
        ServerConfig(defaults={"speed": "fast"})


def test_openai_client(client):
    """The official client (sync, over the in-process app): completions, chat, streaming, errors."""
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    assert [m.id for m in oai.models.list()] == [TINY]
    c = oai.completions.create(model=TINY, prompt="Hello", max_tokens=3, temperature=0)
    assert c.usage.completion_tokens == 3 and isinstance(c.choices[0].text, str)
    chat = oai.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        extra_body={"semkv": {"chunks": ["Some context."], "reuse": "none"}},
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.model_extra["semkv"]["prompt_tokens"] == chat.usage.prompt_tokens
    stream = oai.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        stream=True,
        extra_body={"semkv": {"chunks": ["Some context."], "reuse": "none"}},
    )
    text = "".join(part.choices[0].delta.content or "" for part in stream if part.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=TINY, prompt="x", max_tokens=-5)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4o", prompt="x")


def test_a_write_behind_store_serves_requests_and_reports_its_queue(tiny_app):
    """With ``write_behind`` on (what ``semkv serve`` runs), a repeated prompt is served from the prefix
    its first request stored, /metrics reports the writer, and the prefix blocks reach the disk."""
    app = tiny_app(write_behind=True)
    engine = app.state.semkv.engine
    body = {"model": TINY, "prompt": "The same long prompt, twice. " * 6, "max_tokens": 2, "temperature": 0}
    with TestClient(app, raise_server_exceptions=False) as c:
        first = c.post("/v1/completions", json=body).json()
        second = c.post("/v1/completions", json=body).json()
        text = c.get("/metrics").text
    assert second["semkv"]["path"] == "prefix" and second["semkv"]["reused_tokens"] > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert "semkv_store_write_behind_submitted_total" in text
    assert "semkv_store_write_behind_pending_bytes" in text
    assert engine.store.flush(10)
    disk = engine.store.tier("disk")
    assert disk.stats.writes > 0 and engine.store.writer.stats.written == engine.store.writer.stats.submitted
