"""Two ``semkv serve`` processes (tiny model) on one Redis Cluster behind a ``semkv route`` process."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from pathlib import Path

import httpx

from semkv.route.process import RouteProcess
from semkv.server.process import ServeProcess
from tests.metrics_text import metric

TINY = "tiny"


@dataclass
class RoutedPair:
    backends: list[ServeProcess]
    router: RouteProcess

    def redis_metric(self, backend: int, name: str) -> float:
        text = httpx.get(f"{self.backends[backend].url}/metrics", timeout=30).text
        return metric(text, f"semkv_store_tier_{name}_total", tier="redis")

    def stop(self) -> None:
        self.router.stop()
        for b in self.backends:
            b.stop(timeout=15)


def start_routed_pair(checkpoint: Path, redis_url: str, workdir: Path, *extra: str) -> RoutedPair:
    """Backends (engine stats in every answer: ``--debug-stats``) with memory tier 0 and no disk (every KV hit is read from the cluster), float32 KV
    (reuse is exact), block size 4, one torch thread each; the router polls /health every 0.5 s."""
    args = ("--served-model-name", TINY, "--threads", "1", "--kv-dtype", "float32", "--block-size", "4")
    args += ("--debug-stats",)  # the tests read the engine stats (path, reused tokens) of each answer
    args += ("--redis", redis_url, "--redis-timeout", "0.5", "--no-disk", "--memory-mb", "0", *extra)
    backends = [
        ServeProcess(checkpoint, workdir / f"home-{i}", *args, log_path=workdir / f"serve-{i}.log")
        for i in range(2)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.wait_ready(timeout=180), backends))
        router = RouteProcess([b.url for b in backends], workdir / "route.log", "--health-interval", "0.5")
        router.wait_ready(timeout=60)
    except BaseException:
        for b in backends:
            b.stop()
        raise
    return RoutedPair(backends, router)
