"""The request body limit holds on the bytes received, however the body is framed.

Injected (a real uvicorn server in a thread, a 4 KB limit, raw sockets so nothing reframes the body):
a 100 KB body sent with chunked transfer encoding and no Content-Length (the bypass found on the old
server, which only read Content-Length); then 240 seeded requests of every size from 1 KB to 120 KB,
framed at random (chunked in 1 to 50 chunks of random sizes, or with an exact Content-Length), their
bodies valid JSON (a completion) padded to the size.

Must hold: every body over the limit is a 413 in OpenAI's error shape, every body under it is
served (200); no 5xx; the server's memory (RSS of this process, which runs it) grows less than 40 MB
over the 240 requests after a warm-up; and the server answers a good request afterwards.
"""

from __future__ import annotations

import json
import random

import pytest

from semkv.server import ServerConfig
from tests.server.memory import rss_mb
from tests.server.raw_http import raw_request

TINY = "tiny"
LIMIT = 4096
REQUESTS = 240


def body_of_size(size: int) -> bytes:
    """A valid completion request padded (in the ignored ``user`` field) to exactly ``size`` bytes."""
    base = {"model": TINY, "prompt": "Hello", "max_tokens": 1, "user": ""}
    empty = len(json.dumps(base).encode())
    return json.dumps({**base, "user": "u" * max(0, size - empty)}).encode()


def split(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 49))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@pytest.fixture
def server(live_server):
    return live_server(ServerConfig(max_body_bytes=LIMIT))


def send(server: str, body: bytes, chunks: list[bytes] | None):
    return raw_request(
        server,
        "POST",
        "/v1/completions",
        body=body,
        chunks=chunks,
        headers={"Content-Type": "application/json"},
    )


def test_chunked_body_over_the_limit_is_refused(server):
    big = body_of_size(100_000)
    r = send(server, big, [big[i : i + 4000] for i in range(0, len(big), 4000)])
    assert r.status == 413, (r.status, r.body[:200])
    assert r.json()["error"]["code"] == "too_large"
    r = send(server, big, [big])  # one chunk
    assert r.status == 413
    small = body_of_size(1000)
    assert send(server, small, [small[:10], small[10:]]).status == 200  # chunked and small: served
    assert send(server, small, None).status == 200


def test_fuzzed_sizes_and_framings(server):
    rng = random.Random(18)
    for _ in range(10):  # warm-up: allocator pools, first generations
        send(server, body_of_size(1000), None)
    before = rss_mb()
    statuses: dict[int, int] = {}
    for _ in range(REQUESTS):
        size = rng.choice([rng.randint(1000, LIMIT), rng.randint(LIMIT + 1, 120_000), LIMIT, LIMIT + 1])
        body = body_of_size(size)
        chunks = split(body, rng) if rng.random() < 0.7 else None
        r = send(server, body, chunks)
        statuses[r.status] = statuses.get(r.status, 0) + 1
        assert r.status == (413 if len(body) > LIMIT else 200), (len(body), chunks is not None, r.status)
    growth = rss_mb() - before
    print(
        f"\n[body-limit fuzz] {REQUESTS} requests, statuses {dict(sorted(statuses.items()))}, RSS +{growth:.1f} MB"
    )
    assert growth < 40, f"RSS grew by {growth:.1f} MB over {REQUESTS} requests"
    assert send(server, body_of_size(500), None).status == 200
