"""Serving: a RAG workload from concurrent clients against a local server, with and without reuse.

Each request asks a question over ``--docs-per-request`` documents drawn (seeded) from a pool of
Paul Graham essay excerpts of ``--doc-tokens`` tokens. The same requests run twice against one
server, from ``--clients`` concurrent streaming clients:

* ``full``: documents inline, ``reuse="none"``, nothing stored — every prompt token prefilled;
* ``reuse``: documents uploaded once (``POST /v1/documents``, timed on its own), then named by id,
  ``reuse="auto"`` (blend / prefix / share, whichever reuses most).

Reported per mode: requests/s, client-side TTFT p50/p99 (request sent -> first streamed text,
queueing included), server prefill median, tokens reused / recomputed, the paths taken, and the
agreement of each answer with the same request's full-prefill answer (quality, same run).
A warm-up request is excluded. Without ``--url`` a ``semkv serve`` subprocess is started with a
fresh home (its own empty store) on a free loopback port.

**Routed** (``--backends N --redis URL``, or ``--local-cluster``): the reuse load runs twice behind
``semkv route``, first with one backend, then with N, every backend sharing the Redis tier (a cluster)
under a namespace of its own run, each backend pinned to its own core (``--cores``, taskset) with one
torch thread. Reported per run: requests/s, TTFT, the KV hit rate (reused tokens / prompt tokens), the
requests each backend served and why the router sent them; then N vs 1: throughput ratio, hit-rate
difference, and whether the answers are the same.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from semkv.bench.report import median, write_results
from semkv.config import default_home
from semkv.evaluation.essays import essays, text_of_tokens
from semkv.route.process import RouteProcess
from semkv.server.process import ServeProcess
from semkv.store.redis_process import LocalRedisCluster
from semkv.store.redis_tier import RedisTier

log = logging.getLogger(__name__)

QUESTIONS = [
    "What is the main argument of these passages? Answer in one sentence.",
    "Which passage is most about startups, and why?",
    "Name one piece of advice given in the passages.",
    "What do these passages say about work?",
    "Summarise the first passage in one sentence.",
    "What is a surprising claim made in these passages?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--port", type=int, default=0, help="port of the started server (0: a free one)")
    p.add_argument("--redis", default=None, help="Redis URL for the started server")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--requests", type=int, default=16, help="requests per mode")
    p.add_argument("--docs", type=int, default=8, help="documents in the pool")
    p.add_argument("--docs-per-request", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=256, help="tokens per document")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backends",
        type=int,
        default=0,
        help="routed mode: the reuse load with 1 backend, then with this many, behind semkv route (needs --redis or --local-cluster)",
    )
    p.add_argument(
        "--local-cluster",
        action="store_true",
        help="start a throwaway 3-master + 3-replica Redis Cluster on loopback ports and use it as --redis",
    )
    p.add_argument(
        "--cores",
        default=None,
        help="routed mode: comma-separated cores, backend i pinned to the i-th (default 0,1,...)",
    )
    p.add_argument(
        "--models-dir",
        default=None,
        help="converted models of the started server (default: the default home's, so a fresh home converts nothing)",
    )


@dataclass
class Outcome:
    index: int
    ttft_s: float
    latency_s: float
    text: str
    stats: dict[str, Any] = field(default_factory=dict)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed text chunk


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]): the smallest value with at least q% of the values <= it."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered) / 100)))
    return ordered[rank - 1]


def start_local_server(
    args: argparse.Namespace, *more: str, port: int | None = None, cpus: list[int] | None = None
) -> ServeProcess:
    """``semkv serve`` with the bench's model flags and a fresh home (its own disk store, deleted by
    ``stop`` unless the server crashed)."""
    home = Path(tempfile.mkdtemp(prefix="semkv-bench-serve-"))
    port = args.port if port is None else port
    return ServeProcess(args.model, home, *serve_flags(args), *more, port=port, cpus=cpus, remove_home=True)


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The ``semkv serve`` flags that carry the bench's engine flags (model folder, dtypes, block size,
    threads, ``--no-pack-weights``, ``--no-keep-freed-memory``, Redis) to the server it starts."""
    models_dir = args.models_dir or str(default_home() / "models")
    flags = ["--models-dir", models_dir, "--kv-dtype", args.kv_dtype, "--compute-dtype", args.compute_dtype]
    flags += ["--block-size", str(args.block_size), "--threads", str(args.threads or 1), "--debug-stats"]
    for switch in ("no_pack_weights", "no_keep_freed_memory"):
        if getattr(args, switch, False):
            flags.append("--" + switch.replace("_", "-"))
    if getattr(args, "page_pool_mib", None) is not None:
        flags += ["--page-pool-mib", str(args.page_pool_mib)]
    if args.redis:
        flags += ["--redis", args.redis]
    return flags


def load_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    from semkv.models.loader import resolve_checkpoint

    home = Path(args.home).expanduser() if args.home else default_home()
    models_dir = Path(args.models_dir) if args.models_dir else default_home() / "models"
    return AutoTokenizer.from_pretrained(resolve_checkpoint(args.model, home, models_dir))


def build_workload(args: argparse.Namespace) -> tuple[list[str], list[tuple[list[int], str]]]:
    """(document pool, requests as (document indices, question)), seeded."""
    tokenizer = load_tokenizer(args)
    names = sorted(essays())
    if args.docs > len(names):
        raise ValueError(f"--docs must be <= {len(names)}")
    if not 1 <= args.docs_per_request <= args.docs:
        raise ValueError("--docs-per-request must be in [1, --docs]")
    rng = random.Random(args.seed)
    picked = rng.sample(names, args.docs)
    docs = [text_of_tokens(tokenizer, essays()[n].strip(), args.doc_tokens) for n in picked]
    requests = [
        (rng.sample(range(args.docs), args.docs_per_request), QUESTIONS[i % len(QUESTIONS)])
        for i in range(args.requests)
    ]
    return docs, requests


def stream_one(
    client: httpx.Client, model: str, body_extra: dict[str, Any], question: str, index: int
) -> Outcome:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": body_extra.pop("max_tokens"),
        "temperature": 0,
        "semkv": body_extra,
    }
    return stream_chat(client, body, index)


def stream_chat(client: httpx.Client, body: dict[str, Any], index: int) -> Outcome:
    """POST ``body`` as a streaming chat completion; TTFT is sent -> first text, and every text chunk's
    arrival time (perf_counter) is kept (inter-token latencies)."""
    start = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    stats: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"request {index}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {index}: {chunk['error']}")
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    times.append(time.perf_counter())
                    parts.append(content)
            stats = chunk.get("semkv", stats)
    end = time.perf_counter()
    ttft = (times[0] if times else end) - start
    return Outcome(index, ttft, end - start, "".join(parts), stats, times)


def run_mode(
    base: str, model: str, args: argparse.Namespace, payloads: list[tuple[dict[str, Any], str]]
) -> tuple[list[Outcome], float]:
    """All requests from ``args.clients`` concurrent clients; returns outcomes (in request order) and wall s."""
    with httpx.Client(base_url=base, timeout=600) as client, ThreadPoolExecutor(args.clients) as pool:
        start = time.perf_counter()
        futures = [
            pool.submit(stream_one, client, model, {**extra, "max_tokens": args.max_tokens}, q, i)
            for i, (extra, q) in enumerate(payloads)
        ]
        outcomes = [f.result() for f in futures]
        return outcomes, time.perf_counter() - start


def summarise(
    mode: str,
    outcomes: list[Outcome],
    wall_s: float,
    reference: list[Outcome] | None,
    reference_name: str = "full",
) -> dict[str, Any]:
    ttfts = [o.ttft_s for o in outcomes]
    reused = sum(int(o.stats.get("reused_tokens", 0)) for o in outcomes)
    recomputed = sum(int(o.stats.get("recomputed_tokens", 0)) for o in outcomes)
    paths = Counter(str(o.stats.get("path", "?")) for o in outcomes)
    row: dict[str, Any] = {
        "mode": mode,
        "requests": len(outcomes),
        "requests_per_s": len(outcomes) / wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "prefill_median_s": median([float(o.stats.get("ttft_s", float("nan"))) for o in outcomes]),
        "tokens_reused": reused,
        "tokens_recomputed": recomputed,
        "reused_fraction": reused / max(1, reused + recomputed),
        "hit_rate": reused / max(1, sum(int(o.stats.get("prompt_tokens", 0)) for o in outcomes)),
        "paths": " ".join(f"{p}:{n}" for p, n in sorted(paths.items())),
    }
    if reference is not None:
        same = sum(o.text == r.text for o, r in zip(outcomes, reference, strict=True))
        row[f"same_answer_as_{reference_name}"] = same / len(outcomes)
    return row


def workload_config(args: argparse.Namespace) -> dict[str, Any]:
    names = ("model", "clients", "requests", "docs", "docs_per_request", "doc_tokens", "max_tokens", "seed")
    return {k: getattr(args, k) for k in names}


def speed_ratios(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Requests/s and TTFT p50 / p99 of ``row`` over ``base``."""
    return {
        "requests_per_s_ratio": row["requests_per_s"] / base["requests_per_s"],
        "ttft_p50_ratio": row["ttft_p50_s"] / base["ttft_p50_s"],
        "ttft_p99_ratio": row["ttft_p99_s"] / base["ttft_p99_s"],
    }


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        raise ValueError("--clients, --requests and --max-tokens must be >= 1")
    if args.backends:
        return run_routed(args)
    docs, requests = build_workload(args)
    server = None if args.url else start_local_server(args)
    try:
        if server is not None:
            server.wait_ready(timeout=300.0)
        base = args.url or server.url  # type: ignore[union-attr]
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = {"reuse": "none", "store_prompt": False, "chunks": ["A warm-up passage."], "max_tokens": 2}
        with httpx.Client(base_url=base, timeout=600) as client:
            stream_one(client, model, warm, "Warm up.", -1)

        full_payloads = [
            ({"chunks": [docs[i] for i in idx], "reuse": "none", "store_prompt": False}, q)
            for idx, q in requests
        ]
        full, full_wall = run_mode(base, model, args, full_payloads)

        start = time.perf_counter()
        uploaded = httpx.post(f"{base}/v1/documents", json={"input": docs}, timeout=600).json()["data"]
        upload_s = time.perf_counter() - start
        ids = [d["id"] for d in uploaded]
        reuse_payloads = [({"documents": [ids[i] for i in idx], "reuse": "auto"}, q) for idx, q in requests]
        reuse, reuse_wall = run_mode(base, model, args, reuse_payloads)
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        if server is not None:
            server.stop()

    rows = [summarise("full", full, full_wall, None), summarise("reuse", reuse, reuse_wall, full)]
    ratios = speed_ratios(rows[1], rows[0])
    store = {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in metrics.splitlines()
        if line.startswith(
            ("semkv_store_tier_hits_total", "semkv_store_tier_misses_total", "semkv_store_tier_bytes")
        )
    }
    config = workload_config(args)
    config["server"] = args.url or "local subprocess (fresh home)"
    notes = (
        f"Document upload (precompute of {len(docs)} chunks): {upload_s:.3f} s, not counted in the reuse mode.\n\n"
        f"reuse / full: requests/s x{ratios['requests_per_s_ratio']:.2f}, "
        f"TTFT p50 x{ratios['ttft_p50_ratio']:.2f}, TTFT p99 x{ratios['ttft_p99_ratio']:.2f}; "
        f"answers identical to full prefill: {rows[1]['same_answer_as_full']:.0%}.\n"
    )
    json_path, md_path = write_results(
        args.out,
        "serve",
        rows,
        config,
        extra={
            "ratios": ratios,
            "upload_s": upload_s,
            "documents": uploaded,
            "store_metrics": store,
            "answers": {"full": [o.text for o in full], "reuse": [o.text for o in reuse]},
        },
        notes=notes,
    )
    log.info("wrote %s and %s", json_path, md_path)
    print(md_path.read_text())  # noqa: T201 - the bench's report on the terminal
    return 0


def warm_up(base: str, model: str) -> None:
    warm = {"reuse": "none", "store_prompt": False, "chunks": ["A warm-up passage."], "max_tokens": 2}
    with httpx.Client(base_url=base, timeout=600) as client:
        stream_one(client, model, warm, "Warm up.", -1)


@contextmanager
def warm_local_server(args: argparse.Namespace, *more: str) -> Iterator[tuple[str, str]]:
    """:func:`start_local_server` with ``more`` flags, ready and warmed up: yields (its URL, the served
    model's id); the server is stopped on exit."""
    server = start_local_server(args, *more)
    try:
        server.wait_ready(timeout=300.0)
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm_up(server.url, model)
        yield server.url, model
    finally:
        server.stop()


def routed_counts(router_url: str) -> Counter[tuple[str, str]]:
    """Requests the router has sent, by (backend, reason), from its /metrics."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in httpx.get(f"{router_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("semkv_route_requests_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            counts[(labels["backend"].strip('"'), labels["reason"].strip('"'))] += int(
                float(line.split()[-1])
            )
    return counts


def routed_run(
    args: argparse.Namespace, n: int, cores: list[int], docs: list[str], requests: list[tuple[list[int], str]]
) -> dict[str, Any]:
    """The reuse load through ``semkv route`` over ``n`` fresh backends (backend i pinned to ``cores[i]``)
    sharing the Redis tier under a namespace of this run, which is deleted afterwards."""
    namespace = f"bench{int(time.time())}n{n}"
    backends = [
        start_local_server(args, "--redis-namespace", namespace, port=0, cpus=[cores[i]]) for i in range(n)
    ]
    router: RouteProcess | None = None
    try:
        for b in backends:
            b.wait_ready(timeout=300.0)
        router = RouteProcess([b.url for b in backends], backends[0].home / "route.log")
        router.wait_ready(timeout=60.0)
        model = httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"][0]["id"]
        for b in backends:
            warm_up(b.url, model)
        start = time.perf_counter()
        uploaded = httpx.post(f"{router.url}/v1/documents", json={"input": docs}, timeout=600).json()["data"]
        upload_s = time.perf_counter() - start
        ids = [d["id"] for d in uploaded]
        payloads = [({"documents": [ids[i] for i in idx], "reuse": "auto"}, q) for idx, q in requests]
        before = routed_counts(router.url)
        outcomes, wall = run_mode(router.url, model, args, payloads)
        routed = routed_counts(router.url)
        routed.subtract(before)  # the load's requests only
        served = [sum(v for (url, _), v in routed.items() if url == b.url) for b in backends]
        reasons: Counter[str] = Counter()
        for (_, reason), v in routed.items():
            reasons[reason] += v
    finally:
        if router is not None:
            router.stop()
        for b in backends:
            b.stop()
    cleared = RedisTier(args.redis, namespace=namespace).clear()
    log.info("deleted %d Redis keys of namespace %s", cleared, namespace)
    return {
        "outcomes": outcomes,
        "wall_s": wall,
        "upload_s": upload_s,
        "served": served,
        "reasons": " ".join(f"{r}:{c}" for r, c in sorted(reasons.items()) if c),
    }


def run_routed(args: argparse.Namespace) -> int:
    """1 backend vs ``args.backends`` backends behind the router, on the same load and the same Redis."""
    if args.backends < 2:
        raise ValueError("--backends must be >= 2 (it is compared with one backend)")
    if args.url:
        raise ValueError("--backends starts its own backends; drop --url")
    cores = [int(c) for c in args.cores.split(",")] if args.cores else list(range(args.backends))
    if len(cores) < args.backends:
        raise ValueError(f"--cores names {len(cores)} cores for {args.backends} backends")
    cluster = None
    if args.local_cluster:
        cluster = LocalRedisCluster(
            Path(tempfile.mkdtemp(prefix="semkv-bench-cluster-")), masters=3, replicas=1
        )
        cluster.start()
        args.redis = cluster.url
    if not args.redis:
        raise ValueError("--backends needs a shared Redis tier: --redis URL or --local-cluster")
    try:
        docs, requests = build_workload(args)
        runs = {n: routed_run(args, n, cores, docs, requests) for n in (1, args.backends)}
    finally:
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(cluster.workdir, ignore_errors=True)
    one = runs[1]["outcomes"]
    rows = []
    for n, run_ in runs.items():
        row = summarise(
            f"{n} backend{'s' if n > 1 else ''}", run_["outcomes"], run_["wall_s"], one, "1_backend"
        )
        row["served_per_backend"] = "/".join(str(s) for s in run_["served"])
        row["routing"] = run_["reasons"]
        row["upload_s"] = run_["upload_s"]
        rows.append(row)
    base, many = rows[0], rows[1]
    ratios = {
        **speed_ratios(many, base),
        "hit_rate_relative_difference": (many["hit_rate"] - base["hit_rate"]) / max(1e-9, base["hit_rate"]),
    }
    config = workload_config(args)
    config.update(backends=args.backends, cores=cores, redis="local 3+3 cluster" if cluster else args.redis)
    notes = (
        f"{args.backends} backends vs 1 (each one torch thread on its own core; router and clients unpinned): "
        f"requests/s x{ratios['requests_per_s_ratio']:.2f} (target >= 1.7), "
        f"hit rate {many['hit_rate']:.3f} vs {base['hit_rate']:.3f} "
        f"({100 * ratios['hit_rate_relative_difference']:+.1f}%, target within 10%), "
        f"TTFT p50 x{ratios['ttft_p50_ratio']:.2f}, p99 x{ratios['ttft_p99_ratio']:.2f}; "
        f"answers identical to 1 backend: {many['same_answer_as_1_backend']:.0%}.\n"
    )
    extra = {
        "ratios": ratios,
        "answers": {
            r["mode"]: [o.text for o in runs[n]["outcomes"]] for r, n in zip(rows, runs, strict=True)
        },
    }
    json_path, md_path = write_results(args.out, "serve_routed", rows, config, extra=extra, notes=notes)
    log.info("wrote %s and %s", json_path, md_path)
    print(md_path.read_text())  # noqa: T201 - the bench's report on the terminal
    return 0
