"""Failure mode: a tenant uploads documents past its quota (count, then tokens).

Injected: a server with API keys for two tenants, ``max_documents_per_tenant=3`` and
``max_document_tokens_per_tenant`` a little over three small documents; alice uploads 3 documents (under
two cache salts), then a 4th, then re-uploads one she has, then deletes one and uploads again; a big
document over her token quota; bob uploads beside her. Must happen: the 4th is a 429 in OpenAI's shape
(``code`` "document_quota_exceeded") and computes nothing; re-uploading a document she has is free; after a
delete she has room again; the token quota refuses the big one; bob's uploads are his own quota. On the
old code every upload was accepted.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig
from semkv.server.auth import APIKeys

ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef00"


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def client(tiny_app):
    keys = APIKeys.parse(f"{ALICE} alice\n{BOB} bob")
    config = ServerConfig(api_keys=keys, max_documents_per_tenant=3, max_document_tokens_per_tenant=400)
    with TestClient(tiny_app(config), raise_server_exceptions=False) as c:
        yield c


def upload(client: TestClient, key: str, text: str | list[str], salt: str | None = None):
    body = {"input": text, **({"cache_salt": salt} if salt else {})}
    return client.post("/v1/documents", json=body, headers=headers(key))


def test_document_quota_per_tenant(client):
    first = upload(client, ALICE, ["Memo one about boats.", "Memo two about nets."])
    assert first.status_code == 200, first.text
    assert upload(client, ALICE, "Memo three about fish.", salt="project-x").status_code == 200

    over = upload(client, ALICE, "Memo four about the weather.")
    assert over.status_code == 429, over.text
    error = over.json()["error"]
    assert error["code"] == "document_quota_exceeded" and "3" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}

    assert upload(client, ALICE, "Memo one about boats.").status_code == 200  # she has it: no new document
    assert upload(client, BOB, ["Bob's memo.", "Bob's other memo."]).status_code == 200  # his own quota

    doc_id = first.json()["data"][0]["id"]
    assert client.delete(f"/v1/documents/{doc_id}", headers=headers(ALICE)).status_code == 200
    assert upload(client, ALICE, "Memo four about the weather.").status_code == 200


def test_document_token_quota(client):
    big = " ".join(f"Line {i} of a long report on the harbour." for i in range(60))
    refused = upload(client, ALICE, big)
    assert refused.status_code == 429 and "tokens" in refused.json()["error"]["message"]
    assert client.get("/v1/documents", headers=headers(ALICE)).json()["data"] == []
