"""The OpenAPI pages follow the key rule of ``/v1`` under API keys.

Injected: a server with API keys; ``/openapi.json``, ``/docs``, ``/docs/oauth2-redirect`` and ``/redoc``
asked without a key, with a wrong one and with a valid one; the same pages on a server without keys.
Must happen: 401 in OpenAI's shape (with ``WWW-Authenticate: Bearer``) without a valid key, 200 with one;
without keys they are open. On the old code they were served to anyone under ``--api-keys``.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig
from semkv.server.auth import APIKeys

KEY = "sk-reader-0123456789abcdef"
PAGES = ["/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"]


@pytest.fixture
def keyed(tiny_app):
    with TestClient(tiny_app(ServerConfig(api_keys=APIKeys.parse(f"{KEY} alice")))) as c:
        yield c


@pytest.mark.parametrize("page", PAGES)
def test_pages_need_a_key(keyed, page):
    for headers in ({}, {"Authorization": "Bearer sk-wrong-0123456789abcdef"}):
        r = keyed.get(page, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert keyed.get(page, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_pages_are_open_without_keys(client):
    for page in PAGES:
        assert client.get(page).status_code == 200
