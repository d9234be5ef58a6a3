"""Bad HTTP input is a 4xx; the server stays up and nothing stored is lost.

Injected (an in-process app over a tiny engine whose disk store and documents are on disk, after a
document upload and two completions filled the store): 25 hand-written bad requests — raw bytes that
are not UTF-8 in the JSON body, random binary bodies, a non-JSON content type, NaN / Infinity and
absurd numbers, JSON nested 100 000 deep, unknown and path-traversing document ids in the body
(traversal in the URL is ``tests/server/test_raw_paths.py``: httpx would normalise it), an unknown
model, wrong methods and routes, an empty prompt, a prompt over the context — then 150 seeded
random byte-level mutations of a valid body.

Must happen: no 5xx ever (every answer below 500, every error body JSON with an ``error`` object);
``/health`` answers ok after every request; every stored entry file and document record that
existed before is still present and byte-for-byte unchanged; and the first good request again
returns the same text as before, reusing the stored prefix.
"""

from __future__ import annotations

import json
import random

import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig, create_app
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import engine_at

MODEL = "tiny"
GOOD = {"model": MODEL, "prompt": "Tell me about the harbour.", "max_tokens": 3}
DOC = "The harbour was built in 1820. Ships from the north bring timber and salt."

BAD_RAW = [  # (body bytes, content type)
    (b'{"model": "tiny", "prompt": "caf\xe9", "max_tokens": 2}', "application/json"),
    (b'{"model": "tiny", "prompt": "\xff\xfe\xfd", "max_tokens": 2}', "application/json"),
    (b"\xff\xfe{\x00\x00", "application/json"),
    (bytes(range(256)), "application/json"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}', "text/plain"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN, "max_tokens": 2}', "application/json"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": Infinity, "max_tokens": 2}', "application/json"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e400}', "application/json"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 99999999999999999999999}', "application/json"),
]
BAD_JSON = [  # (method, path, json body)
    ("post", "/v1/completions", {**GOOD, "prompt": ""}),
    ("post", "/v1/completions", {**GOOD, "prompt": "word " * 2100}),
    ("post", "/v1/completions", {**GOOD, "max_tokens": -1}),
    ("post", "/v1/completions", {**GOOD, "model": "no-such-model"}),
    ("post", "/v1/completions", {**GOOD, "semkv": {"documents": ["doc-" + "0" * 32]}}),
    ("post", "/v1/completions", {**GOOD, "semkv": {"documents": ["../../../etc/passwd"]}}),
    ("post", "/v1/completions", {**GOOD, "semkv": {"documents": ["doc-\x00"]}}),
    ("post", "/v1/completions", {**GOOD, "semkv": {"reuse": "bogus"}}),
    ("post", "/v1/completions", {**GOOD, "semkv": {"recompute_ratio": 7}}),
    ("post", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}),
    ("post", "/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("post", "/v1/documents", {"input": ""}),
    ("post", "/v1/documents", {"input": 42}),
    ("get", "/v1/documents/doc-nope", None),
    ("delete", "/v1/completions", None),
]
MUTATIONS = 150


@pytest.fixture
def served(tmp_path, tokenizer):
    engine = engine_at(tmp_path / "home", tokenizer, tiny_hf_model("llama", len(tokenizer)))
    engine.name = MODEL
    config = ServerConfig(debug_stats=True)  # the check below reads reused_tokens
    with TestClient(create_app(engine, config), raise_server_exceptions=False) as client:
        doc = client.post("/v1/documents", json={"input": DOC})
        assert doc.status_code == 200, doc.text
        doc_id = doc.json()["data"][0]["id"]
        first = client.post("/v1/completions", json={**GOOD, "semkv": {"documents": [doc_id]}})
        assert first.status_code == 200, first.text
        good = client.post("/v1/completions", json=GOOD)
        assert good.status_code == 200
        yield client, tmp_path / "home", good.json()["choices"][0]["text"]


def snapshot(home):
    return {
        p: p.read_bytes()
        for p in home.rglob("*")
        if p.is_file() and "quarantine" not in p.parts and p.name != "usage.jsonl"
    }


def check_alive_and_intact(client, home, before, response):
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert "error" in response.json()
    assert client.get("/health").status_code == 200
    now = snapshot(home)
    lost = [str(p) for p, data in before.items() if now.get(p) != data]
    assert not lost, f"stored files lost or changed: {lost[:3]}"


def test_bad_requests_are_4xx_and_lose_nothing(served):
    client, home, good_text = served
    before = snapshot(home)
    assert any(p.suffix == ".skv" for p in before)
    for body, content_type in BAD_RAW:
        r = client.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert 400 <= r.status_code < 500, (body[:40], r.status_code, r.text[:200])
        check_alive_and_intact(client, home, before, r)
    for method, path, body in BAD_JSON:
        if body is None:
            r = client.request(method, path)
        else:  # json.dumps escapes lone surrogates as \\ud800, as a client library would
            r = client.request(
                method, path, content=json.dumps(body), headers={"content-type": "application/json"}
            )
        assert 400 <= r.status_code < 500, (path, body and str(body)[:60], r.status_code, r.text[:200])
        check_alive_and_intact(client, home, before, r)
    again = client.post("/v1/completions", json=GOOD)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == good_text
    assert again.json()["semkv"]["reused_tokens"] > 0


def test_mutated_bodies_never_5xx(served):
    client, home, good_text = served
    before = snapshot(home)
    valid = b'{"model": "tiny", "prompt": "Tell me about the harbour.", "max_tokens": 2, "semkv": {"reuse": "auto"}}'
    rng = random.Random(99)
    statuses: dict[int, int] = {}
    for _ in range(MUTATIONS):
        body = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            op, at = rng.random(), rng.randrange(len(body))
            if op < 0.4:
                body[at] = rng.randrange(256)
            elif op < 0.7:
                del body[at]
            else:
                body.insert(at, rng.choice(b'{}[]",:\\0e-\xff\xc3'))
        r = client.post("/v1/completions", content=bytes(body), headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check_alive_and_intact(client, home, before, r)
    print(f"\n[http-mutations] {MUTATIONS} mutated bodies, statuses {dict(sorted(statuses.items()))}")
    again = client.post("/v1/completions", json=GOOD)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == good_text
