"""Failure mode: a document upload runs past the request deadline.

Injected: a server with ``request_timeout_s=1`` gets 64 long documents in one upload (together several
seconds of engine work on the tiny model). Must happen: a 504 "deadline_exceeded" in OpenAI's shape
within about the deadline plus one document's compute; no document is registered; the server serves
the next request. On the old code the upload had no deadline: a 200 after all 64 documents.
"""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from semkv.server import ServerConfig
from tests.server.conftest import TINY
from tests.server.test_upload_client_gone import DOCUMENTS, document

DEADLINE_S = 1.0


def test_an_upload_past_its_deadline_is_a_504(tiny_app):
    with TestClient(
        tiny_app(ServerConfig(request_timeout_s=DEADLINE_S)), raise_server_exceptions=False
    ) as client:
        start = time.perf_counter()
        r = client.post("/v1/documents", json={"input": [document(i) for i in range(DOCUMENTS)]})
        took = time.perf_counter() - start
        assert r.status_code == 504, r.text[:200]
        assert r.json()["error"]["code"] == "deadline_exceeded"
        assert took < DEADLINE_S + 2.0
        assert client.get("/v1/documents").json()["data"] == []
        probe = client.post("/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 1})
        assert probe.status_code == 200
