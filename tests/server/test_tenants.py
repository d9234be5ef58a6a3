"""Tenants: API keys, per-tenant (and per-salt) cache namespaces, scoped documents, hidden stats.

Injected: one server with three API keys (alice, bob; ops may publish shared documents and read
/metrics), ``debug_stats`` on, so every engine stat is visible — the worst case for isolation. Requests
without a key, with a wrong key; the same long prompt sent by two tenants and by one tenant with two
cache salts; documents uploaded by one tenant and looked up, used and deleted by another; shared
documents published with and without the permission. A second server without ``debug_stats``.

Must hold: no key or a wrong key is a 401 on every /v1 route (and /metrics); a prompt stored by one
tenant (or salt) is never reused by another — no prefix block, no shared prompt, no chunk: the other
tenant's first request is a full prefill; another tenant's document does not exist for it (list, get,
use, delete), while a shared one is listed, used (its chunk KV hit) and deletable by its publisher
only; a deleted document's chunk KV leaves the store; without ``debug_stats`` a response carries only
its own token counts and timings.
"""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig
from semkv.server.app import PUBLIC_STATS
from semkv.server.auth import APIKeys

TINY = "tiny"
KEYS = {
    "alice": "sk-alice-0123456789abcdef",
    "bob": "sk-bob-0123456789abcdef",
    "ops": "sk-ops-0123456789abcdef",
}
KEY_FILE = f"""
# key                       tenant   permissions
{KEYS["alice"]}  alice
{KEYS["bob"]}    bob
{KEYS["ops"]}    ops      shared,metrics
"""
PROMPT = "The quarterly memo of Northwind Traders says revenue rose in every region. " * 4  # > 64 tokens
DOC = "Northwind Traders internal memo: the merger with Contoso closes on March 3rd. " * 3


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture
def keyed(tiny_app):
    """A TestClient over a server with API keys and debug_stats."""
    config = ServerConfig(api_keys=APIKeys.parse(KEY_FILE), debug_stats=True)
    with TestClient(tiny_app(config), raise_server_exceptions=False) as client:
        yield client


def complete(client, tenant: str, prompt: str = PROMPT, **extra) -> dict:
    body = {"model": TINY, "prompt": prompt, "max_tokens": 2, **extra}
    r = client.post("/v1/completions", json=body, headers=auth(tenant))
    assert r.status_code == 200, r.text
    return r.json()["semkv"]


def test_keys_are_required_on_v1_routes(keyed):
    for method, path in [
        ("get", "/v1/models"),
        ("post", "/v1/completions"),
        ("post", "/v1/chat/completions"),
        ("get", "/v1/documents"),
        ("post", "/v1/documents"),
        ("delete", "/v1/documents/doc-" + "0" * 32),
        ("get", "/metrics"),
    ]:
        for headers in (
            {},
            {"Authorization": "Bearer sk-nobody-0123456789"},
            {"Authorization": KEYS["alice"]},
        ):
            r = keyed.request(method, path, headers=headers, json={"model": TINY, "prompt": "x"})
            assert r.status_code == 401, (method, path, headers, r.text)
            assert (
                r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            )
    assert keyed.get("/v1/models", headers=auth("alice")).status_code == 200
    assert keyed.get("/metrics", headers=auth("alice")).status_code == 403  # no metrics permission
    assert "semkv_requests_total" in keyed.get("/metrics", headers=auth("ops")).text
    assert keyed.get("/health").json() == {"status": "ok", "model": TINY}  # nothing about other tenants
    oai = openai.OpenAI(
        base_url="http://testserver/v1", api_key=KEYS["bob"], http_client=keyed, max_retries=0
    )
    assert oai.completions.create(model=TINY, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url="http://testserver/v1", api_key="sk-wrong-0123456789", http_client=keyed, max_retries=0
        ).models.list()


def test_tenants_and_salts_never_reuse_each_others_kv(keyed):
    first = complete(keyed, "alice")
    assert first["reused_tokens"] == 0
    again = complete(keyed, "alice")
    assert again["reused_tokens"] >= again["prompt_tokens"] - 8  # alice reuses her own prompt
    bob = complete(keyed, "bob")  # the same prompt, another tenant
    assert bob["path"] == "full" and bob["reused_tokens"] == 0, bob
    assert bob["refused"]["share"] == "no stored prompt to share from", bob["refused"]
    edited = complete(
        keyed, "bob", PROMPT.replace("Northwind", "Northwand", 1), share={"min_match_rate": 0.0}
    )
    assert edited["reused_tokens"] > 0 and edited["path"] in ("prefix", "share")  # bob's own prompt only
    salted = complete(keyed, "alice", cache_salt="user-42")  # alice, another salt
    assert salted["path"] == "full" and salted["reused_tokens"] == 0, salted
    assert complete(keyed, "alice", cache_salt="user-42")["reused_tokens"] > 0
    chat = {"model": TINY, "messages": [{"role": "user", "content": "Chat: " + PROMPT}], "max_tokens": 2}
    keyed.post("/v1/chat/completions", json=chat, headers=auth("alice"))
    assert (
        keyed.post("/v1/chat/completions", json=chat, headers=auth("alice")).json()["semkv"]["reused_tokens"]
        > 0
    )
    fresh = {**chat, "cache_salt": "never-used"}  # bob in a namespace that holds nothing of his own
    assert (
        keyed.post("/v1/chat/completions", json=fresh, headers=auth("bob")).json()["semkv"]["reused_tokens"]
        == 0
    )


def test_tenant_and_salt_cannot_be_set_through_semkv(keyed):
    for option, param in [({"tenant": "alice"}, "semkv.tenant"), ({"cache_salt": "x"}, "semkv.cache_salt")]:
        r = keyed.post(
            "/v1/completions", json={"model": TINY, "prompt": "x", "semkv": option}, headers=auth("bob")
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_documents_are_scoped_to_their_namespace(keyed):
    up = keyed.post("/v1/documents", json={"input": DOC}, headers=auth("alice"))
    assert up.status_code == 200, up.text
    doc = up.json()["data"][0]
    assert doc["shared"] is False and doc["precomputed"]
    doc_id = doc["id"]
    assert [d["id"] for d in keyed.get("/v1/documents", headers=auth("alice")).json()["data"]] == [doc_id]
    assert keyed.get("/v1/documents", headers=auth("bob")).json()["data"] == []
    assert keyed.get(f"/v1/documents/{doc_id}", headers=auth("bob")).status_code == 404
    use = {"model": TINY, "prompt": "When does it close?", "max_tokens": 2, "semkv": {"documents": [doc_id]}}
    assert keyed.post("/v1/completions", json=use, headers=auth("bob")).status_code == 404
    assert keyed.delete(f"/v1/documents/{doc_id}", headers=auth("bob")).status_code == 404
    salted = keyed.get("/v1/documents", params={"cache_salt": "s"}, headers=auth("alice")).json()["data"]
    assert salted == []  # another salt of the same tenant is another namespace
    served = keyed.post(
        "/v1/completions", json={**use, "semkv": {**use["semkv"], "reuse": "blend"}}, headers=auth("alice")
    )
    assert served.status_code == 200 and served.json()["semkv"]["chunk_hits"] == 1
    store = keyed.app.state.semkv.engine.store
    assert all(store.contains(key) for key in doc["chunk_ids"])
    gone = keyed.delete(f"/v1/documents/{doc_id}", headers=auth("alice"))
    assert gone.status_code == 200 and gone.json() == {"id": doc_id, "object": "document", "deleted": True}
    assert not any(store.contains(key) for key in doc["chunk_ids"])  # its KV left every tier
    assert keyed.get(f"/v1/documents/{doc_id}", headers=auth("alice")).status_code == 404
    assert keyed.post("/v1/completions", json=use, headers=auth("alice")).status_code == 404


def test_shared_documents_need_the_permission(keyed):
    denied = keyed.post("/v1/documents", json={"input": DOC, "shared": True}, headers=auth("alice"))
    assert denied.status_code == 403 and denied.json()["error"]["param"] == "shared"
    up = keyed.post("/v1/documents", json={"input": DOC, "shared": True}, headers=auth("ops"))
    assert up.status_code == 200, up.text
    doc = up.json()["data"][0]
    assert doc["shared"] is True
    listed = keyed.get("/v1/documents", headers=auth("bob")).json()["data"]
    assert [d["id"] for d in listed] == [doc["id"]] and listed[0]["shared"] is True
    use = {
        "model": TINY,
        "prompt": "When does it close?",
        "max_tokens": 2,
        "semkv": {"documents": [doc["id"]], "reuse": "blend"},
    }
    stats = keyed.post("/v1/completions", json=use, headers=auth("bob")).json()["semkv"]
    assert stats["path"] == "blend" and stats["chunk_hits"] == 1  # the published chunk KV is used
    assert keyed.delete(f"/v1/documents/{doc['id']}", headers=auth("bob")).status_code == 404
    assert keyed.get(f"/v1/documents/{doc['id']}", headers=auth("bob")).status_code == 200
    assert keyed.delete(f"/v1/documents/{doc['id']}", headers=auth("ops")).status_code == 200
    assert keyed.get("/v1/documents", headers=auth("bob")).json()["data"] == []


def test_stats_about_other_requests_are_hidden_by_default(tiny_app):
    with TestClient(tiny_app(ServerConfig()), raise_server_exceptions=False) as client:
        body = {"model": TINY, "prompt": PROMPT, "max_tokens": 2}
        client.post("/v1/completions", json=body)
        edited = {**body, "prompt": PROMPT.replace("memo", "note", 1), "semkv": {"reuse": "share"}}
        for request in (body, edited, {**body, "stream": True}):
            r = client.post("/v1/completions", json=request)
            assert r.status_code == 200
            if request.get("stream"):
                final = [e for e in r.text.splitlines() if '"semkv"' in e]
                assert len(final) == 1
                stats = json.loads(final[0][len("data: ") :])["semkv"]
            else:
                stats = r.json()["semkv"]
            assert set(stats) <= PUBLIC_STATS, sorted(set(stats) - PUBLIC_STATS)
            assert stats["prompt_tokens"] > 64 and "path" not in stats and "refused" not in stats
            assert isinstance(stats["reused_tokens"], int)  # a count of its own reused tokens, nothing more
