"""A document is in every tier when its upload answers: a second server sharing the Redis tier reuses it
on the first request after the 200.

Injected: two servers (apps over tiny engines with the same weights, each with its own disk tier, both on
one real ``redis-server``, writing behind as ``semkv serve`` does); server A is busy writing behind (a long prompt's prefix blocks queued for its
disk and Redis tiers) when a document is uploaded to it. Right after A's 200, server B gets a request that
names the document (blend). Must happen: B loads the document's chunk from Redis: at least 80% of its
tokens reused. On the old code the upload answered while its chunk still waited behind A's queue, and B
recomputed it (0 tokens reused).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.server.conftest import TINY

LONG_PROMPT = " ".join(
    f"Line {i} of the ship's log: wind {i % 9} knots, course {i * 37 % 360}." for i in range(90)
)
DOCUMENT = " ".join(
    f"The lighthouse keeper's note {i}: the lamp was lit at {18 + i % 4} o'clock and the sea was calm."
    for i in range(12)
)


@pytest.fixture
def two_servers(tiny_app, redis_server):
    store = {"redis_url": redis_server.url, "write_behind": True}  # as `semkv serve` writes
    apps = [tiny_app(**store), tiny_app(**store)]
    with TestClient(apps[0], raise_server_exceptions=False) as a, TestClient(apps[1]) as b:
        yield a, b


def test_a_document_is_reused_by_another_server_right_after_its_upload(two_servers):
    a, b = two_servers
    busy = a.post("/v1/completions", json={"model": TINY, "prompt": LONG_PROMPT, "max_tokens": 1})
    assert busy.status_code == 200 and busy.json()["usage"]["prompt_tokens"] > 1000

    upload = a.post("/v1/documents", json={"input": DOCUMENT})
    assert upload.status_code == 200, upload.text
    doc = upload.json()["data"][0]
    ask = {
        "model": TINY,
        "messages": [{"role": "user", "content": "When was the lamp lit?"}],
        "max_tokens": 2,
        "semkv": {"documents": [doc["id"]], "reuse": "blend"},
    }
    stats = b.post("/v1/chat/completions", json=ask).json()["semkv"]

    assert doc["tokens"] > 150
    assert stats["path"] == "blend", stats
    assert stats["reused_tokens"] >= 0.8 * doc["tokens"], (stats["reused_tokens"], doc["tokens"])
