"""Injected: the server's Redis URL points at a port nothing listens on (Redis down at start).
Must hold: the server starts, answers requests from its local tiers, and reports the outage in
/health and /metrics without paying a timeout per store lookup."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from semkv.server import ServerConfig, create_app
from semkv.server.process import free_port


def test_server_serves_with_redis_down(make_tiny_engine):
    engine = make_tiny_engine("llama", redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=0.5)
    engine.name = "tiny"
    with TestClient(create_app(engine, ServerConfig(debug_stats=True))) as client:
        assert client.get("/health").json()["redis"] == "down"
        request = {
            "model": "tiny",
            "prompt": "A prompt long enough to fill a few blocks " * 4,
            "max_tokens": 2,
        }
        start = time.perf_counter()
        first = client.post("/v1/completions", json=request)
        second = client.post("/v1/completions", json=request)
        elapsed = time.perf_counter() - start
        assert first.status_code == second.status_code == 200
        assert second.json()["semkv"]["reused_tokens"] > 0  # served from the memory tier
        assert elapsed < 5.0, f"two requests took {elapsed:.2f} s with Redis down"
        text = client.get("/metrics").text
        assert 'semkv_store_tier_outages_total{tier="redis"} 1.0' in text
        unavailable = next(
            x for x in text.splitlines() if x.startswith('semkv_store_tier_unavailable_total{tier="redis"}')
        )
        assert float(unavailable.split()[-1]) > 10
