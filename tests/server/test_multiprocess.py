"""Two ``semkv serve`` processes, one real redis-server (each server with its own home and disk store).

Injected: a document uploaded to server A only; a prompt prefilled on A only; then Redis killed.
Must hold: B blends the document from the chunk KV A stored in Redis (its stats and /metrics show the
reuse and the Redis hits), B reuses A's prefix blocks, and with Redis gone B still answers from its
local tiers, reporting the outage in /health and /metrics.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from semkv.reuse.registry import REUSE_MODES
from tests.metrics_text import metric

TINY = "tiny"
DOCS = [
    "The lighthouse keeper on the northern island logs every passing ship in a green ledger. "
    "In the winter of the great storm he recorded forty-one vessels, and all of them reached port safely.",
    "Marmalade was first sold in Dundee by a grocer whose ship had brought a cargo of bitter oranges. "
    "His wife boiled them with sugar, and the jars sold out in a single afternoon at the harbour market.",
]


def wait_written_behind(client: httpx.Client, timeout_s: float = 30.0) -> None:
    """Wait until the server's write-behind queue is empty (its KV has reached Redis): a response comes
    back once the memory tier holds the KV, and the tiers below are written after it."""
    deadline = time.monotonic() + timeout_s
    gauge = "semkv_store_write_behind_pending_entries"
    while True:
        text = client.get("/metrics").text
        assert gauge in text, "the server writes through, not behind"
        if metric(text, gauge) == 0:
            return
        assert time.monotonic() < deadline, "write-behind queue not drained"
        time.sleep(0.05)


def test_two_servers_share_one_redis(redis_server, tiny_checkpoint, serve_process, tmp_path):
    assert "blend" in REUSE_MODES
    # no warm-up: its prompt's blocks would be Redis writes too, and B's writes count the chunks it computed
    args = ("--redis", redis_server.url, "--redis-timeout", "0.5", "--warmup-tokens", "0")
    a = serve_process(tiny_checkpoint, tmp_path / "home-a", *args)
    b = serve_process(tiny_checkpoint, tmp_path / "home-b", *args)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: p.wait_ready(), (a, b)))
    ca, cb = httpx.Client(base_url=a.url, timeout=60), httpx.Client(base_url=b.url, timeout=60)
    assert ca.get("/health").json()["redis"] == "up" and cb.get("/health").json()["redis"] == "up"

    # 1. A document uploaded to A is blended on B from the chunk KV A put in Redis.
    uploaded = ca.post("/v1/documents", json={"input": DOCS}).json()["data"]
    assert all(d["precomputed"] for d in uploaded)
    wait_written_behind(ca)
    doc_ids = [d["id"] for d in uploaded]
    assert cb.get(f"/v1/documents/{doc_ids[0]}").json()["text"] == DOCS[0]  # registry shared via Redis
    question = {"model": TINY, "prompt": "Who sold the first marmalade?", "max_tokens": 3}
    baseline = cb.post(
        "/v1/completions",
        json={**question, "semkv": {"chunks": DOCS, "reuse": "none", "store_prompt": False}},
    )
    assert baseline.status_code == 200 and baseline.json()["semkv"]["reused_tokens"] == 0
    blended = cb.post("/v1/completions", json={**question, "semkv": {"documents": doc_ids, "reuse": "blend"}})
    stats = blended.json()["semkv"]
    doc_tokens = sum(d["tokens"] for d in uploaded)
    assert stats["path"] == "blend", stats["refused"]
    assert stats["reused_tokens"] >= 0.5 * doc_tokens, (stats, doc_tokens)
    assert stats["recomputed_tokens"] < baseline.json()["semkv"]["recomputed_tokens"]
    metrics_b = cb.get("/metrics").text
    assert metric(metrics_b, "semkv_store_tier_hits_total", tier="redis") >= len(DOCS)
    assert metric(metrics_b, "semkv_tokens_reused_total", path="blend") == stats["reused_tokens"]
    assert metric(metrics_b, "semkv_store_tier_writes_total", tier="redis") < len(DOCS)  # B computed no chunk
    assert metric(ca.get("/metrics").text, "semkv_store_tier_writes_total", tier="redis") >= len(DOCS)

    # 2. A prompt prefilled on A: B reuses its prefix blocks through Redis.
    prompt = {"model": TINY, "prompt": " ".join(DOCS) + " Summarise.", "max_tokens": 2}
    on_a = ca.post("/v1/completions", json=prompt).json()["semkv"]  # may reuse the chat template's blocks
    wait_written_behind(ca)
    hits_before = metric(cb.get("/metrics").text, "semkv_store_tier_hits_total", tier="redis")
    on_b = cb.post("/v1/completions", json=prompt).json()["semkv"]
    assert on_b["path"] == "prefix" and on_b["reused_tokens"] >= 0.8 * on_b["prompt_tokens"], on_b
    assert on_b["reused_tokens"] > on_a["reused_tokens"] + 32
    assert metric(cb.get("/metrics").text, "semkv_store_tier_hits_total", tier="redis") > hits_before

    # 3. Redis killed mid-run: B keeps serving from its local tiers and reports the outage.
    redis_server.stop()
    fresh = {"model": TINY, "prompt": "A question nobody asked before, about tides.", "max_tokens": 2}
    r = cb.post("/v1/completions", json=fresh)
    assert r.status_code == 200
    again = cb.post("/v1/completions", json={**question, "semkv": {"documents": doc_ids, "reuse": "blend"}})
    assert again.status_code == 200 and again.json()["semkv"]["path"] == "blend"  # chunks now local to B
    assert cb.get("/health").json()["redis"] == "down"
    metrics_b = cb.get("/metrics").text
    assert metric(metrics_b, "semkv_store_tier_outages_total", tier="redis") >= 1
    assert metric(metrics_b, "semkv_store_tier_errors_total", tier="redis") >= 1
    unknown = cb.post("/v1/completions", json={**question, "semkv": {"documents": ["doc-" + "2" * 32]}})
    assert unknown.status_code == 404
    assert "Redis" in b.log() and "unavailable" in b.log()
