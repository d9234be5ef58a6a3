"""Concurrency over a real uvicorn server (in a thread): queued requests are served without
cross-request contamination, and streaming does not wait for the whole generation.

Injected: 8 clients at once (half streaming, chat and completions mixed, sharing a prompt prefix
so their prefix blocks meet in the store). Must hold: every output equals the same request's
output sent alone, token for token.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from semkv.server import ServerConfig
from tests.conftest import tiny_hf_model

TINY = "tiny"
TOPICS = [
    "Rain in Paris",
    "Snow on Mount Fuji",
    "Wind near Chicago",
    "Fog over London bridges",
    "Heat in Death Valley",
    "Storms at sea",
    "Hail over Kansas",
    "Sunshine in Lisbon",
]
SHARED = "You are a helpful assistant who answers questions about the weather in great detail. " * 3


@pytest.fixture
def live_server(live_server, tiny_app, tokenizer):
    """start(config=None) -> base URL of a live server (tests/server/conftest.py) over a tiny app whose
    weights are drawn 5x wider than the default so its greedy output depends on the prompt (with the
    default init and a small vocabulary, distinct prompts can all give one output)."""

    def start(config: ServerConfig | None = None) -> str:
        hf_model = tiny_hf_model("llama", len(tokenizer), initializer_range=0.1)
        return live_server(app=tiny_app(config, hf_model=hf_model))

    return start


def make_requests() -> list[tuple[str, dict]]:
    requests = []
    for i in range(8):
        question = f"{TOPICS[i]}? Answer about day {i * 7 + 3}."
        options = {"max_tokens": 10, "semkv": {"reuse": "prefix"}, "stream": i % 2 == 1}
        if i % 4 < 2:
            requests.append(("/v1/completions", {"model": TINY, "prompt": SHARED + question, **options}))
        else:
            messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]
            requests.append(("/v1/chat/completions", {"model": TINY, "messages": messages, **options}))
    return requests


def send(base: str, route: str, body: dict) -> tuple[str, int]:
    """(text, completion tokens) of one request, streamed or not."""
    with httpx.Client(base_url=base, timeout=60) as c:
        if not body["stream"]:
            r = c.post(route, json=body)
            assert r.status_code == 200, r.text
            data = r.json()
            choice = data["choices"][0]
            return choice.get("text", choice.get("message", {}).get("content")), data["usage"][
                "completion_tokens"
            ]
        parts, tokens = [], None
        with c.stream("POST", route, json={**body, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        return "".join(parts), tokens


def test_eight_concurrent_clients_match_sequential(live_server):
    base = live_server()
    requests = make_requests()
    for route, body in requests:  # warm-up pass: stores the prefix blocks every later pass reuses
        send(base, route, body)
    alone = [send(base, route, body) for route, body in requests]
    assert len(set(alone)) >= 6, (
        "distinct requests should mostly give distinct outputs (else no contamination shows)"
    )

    results: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = send(base, *requests[i])
        except BaseException as exc:  # surfaced below
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == alone
    metrics = httpx.get(f"{base}/metrics").text
    completions = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("semkv_requests_total{") and 'status="200"' in line and "completions" in line
    )
    assert completions == 3 * len(requests)


def test_stream_arrives_before_the_generation_ends(live_server):
    """The first SSE chunk reaches the client long before the last (tokens are not buffered).

    A first request of the same shape runs before the measured one: a fresh process's first prefill
    builds its CPU kernels (on AMX tenths of a second), which would count in the first chunk's time."""
    base = live_server()
    body = {"model": TINY, "prompt": "Tell me everything.", "max_tokens": 96, "stream": True}
    body["semkv"] = {"stop_at_eos": False}
    arrivals = []
    with httpx.Client(base_url=base, timeout=60) as c:
        assert c.post("/v1/completions", json={**body, "stream": False}).status_code == 200
        start = time.perf_counter()
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter() - start)
    assert len(arrivals) > 20
    assert arrivals[0] < 0.5 * arrivals[-1], (arrivals[0], arrivals[-1])


def test_full_queue_is_a_429(live_server):
    """With a queue of 1, a burst gets some 429s in OpenAI's shape and every other request succeeds."""
    base = live_server(ServerConfig(max_queue=1))
    body = {"model": TINY, "prompt": "Hello", "max_tokens": 48, "semkv": {"stop_at_eos": False}}
    statuses: list[int] = []

    def client() -> None:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "queue_full"

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(set(statuses)) == [200, 429], statuses
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
