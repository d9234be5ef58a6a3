"""``usage.prompt_tokens_details.cached_tokens``: a request's own reused prompt tokens, on every response.

A server with API keys and the default stats (no ``debug_stats``). Injected: one prompt asked twice by
tenant alice, then by tenant bob and by alice under another ``cache_salt``, through chat and completions,
whole and streamed (``stream_options.include_usage``). Must hold: every response's usage carries
``prompt_tokens_details.cached_tokens``; alice's repeat has cached_tokens > 0 (its prefix blocks are in
the store); bob and the other salt get 0 for the same prompt (reuse never crosses a namespace); the
``semkv`` field says how many prompt tokens were reused (``reused_tokens``, equal to cached_tokens) without
``debug_stats``, and nothing else about reuse (no path, no refusals).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig
from semkv.server.app import PUBLIC_STATS
from semkv.server.auth import APIKeys

TINY = "tiny"
KEYS = {"alice": "sk-alice-0123456789abcdef", "bob": "sk-bob-0123456789abcdef"}
PROMPT = "The quarterly memo of Northwind Traders says revenue rose in every region. " * 4


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture
def client(tiny_app):
    config = ServerConfig(api_keys=APIKeys.parse("\n".join(f"{k} {t}" for t, k in KEYS.items())))
    with TestClient(tiny_app(config), raise_server_exceptions=False) as c:
        yield c


def ask(client, route: str, tenant: str, stream: bool = False, **extra) -> tuple[dict, dict]:
    """(usage, semkv stats) of one request."""
    if route == "/v1/completions":
        body = {"model": TINY, "prompt": PROMPT, "max_tokens": 2, **extra}
    else:
        body = {"model": TINY, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, **extra}
    if not stream:
        r = client.post(route, json=body, headers=auth(tenant))
        assert r.status_code == 200, r.text
        return r.json()["usage"], r.json()["semkv"]
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = client.post(route, json=body, headers=auth(tenant))
    assert r.status_code == 200, r.text
    events = [json.loads(line[len("data: ") :]) for line in r.text.splitlines() if line.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    stats = [e["semkv"] for e in events if "semkv" in e]
    assert len(usage) == 1 and len(stats) == 1, events
    return usage[0], stats[0]


def cached(usage: dict) -> int:
    assert set(usage) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    value = usage["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(value, int) and 0 <= value <= usage["prompt_tokens"]
    return value


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_cached_tokens_count_own_reuse_only(client, route, stream):
    first, _ = ask(client, route, "alice", stream)
    assert cached(first) == 0  # nothing stored yet
    again, stats = ask(client, route, "alice", stream)
    assert cached(again) > 0 and cached(again) >= again["prompt_tokens"] // 2, again
    assert stats["reused_tokens"] == cached(again)
    assert set(stats) <= PUBLIC_STATS and "path" not in stats and "refused" not in stats, stats
    other_tenant, stats = ask(client, route, "bob", stream)
    assert cached(other_tenant) == 0 and stats["reused_tokens"] == 0
    other_salt, stats = ask(client, route, "alice", stream, cache_salt="elsewhere")
    assert cached(other_salt) == 0 and stats["reused_tokens"] == 0


def test_a_multi_prompt_completion_sums_its_choices(client):
    ask(client, "/v1/completions", "alice")
    body = {"model": TINY, "prompt": [PROMPT, PROMPT], "max_tokens": 2}
    r = client.post("/v1/completions", json=body, headers=auth("alice"))
    assert r.status_code == 200, r.text
    usage, stats = r.json()["usage"], r.json()["semkv"]
    assert cached(usage) == sum(s["reused_tokens"] for s in stats) > 0
