"""``semkv bench batching --sweep 1,2,4,8,16``: the serving mix from 1..N concurrent streaming clients, against
a batching server and the same server with batching off (``--max-running 1``), in one run.

The load (:mod:`semkv.bench.serving_mix`, seeded): RAG over uploaded documents named by id, chat
follow-ups (prefix reuse), reworded prompts (share) and a few long prompts (``--long-tokens``, >= 2K)
decoded with a sparse policy set per request (``--sparse-policy`` / ``--sparse-budget``), all with
``reuse="auto"`` and the chat template (the server applies it to chat completions), greedy.

Servers and state: one ``semkv serve`` per mode, each with a fresh home (empty store), the same flags
but ``--max-running`` (1, or max(``--max-running``, largest client count)), warmed up by the same request.
Both modes run the client counts in the same order; each point runs in a cache namespace of its own
(``cache_salt`` = the point), its documents uploaded into that namespace first (upload not timed), so
every point of either mode starts from the same empty namespace: nothing one point stored is reused by
another, and the two modes see equivalent reuse state.

Per client count and mode: output tokens/s, requests/s, TTFT p50/p99 (sent -> first streamed text),
inter-token latency p50/p99 (gaps between consecutive streamed chunks, client side), answers equal
between the modes; then batching / no batching of output tokens/s. Plots next to the JSON.

Sizing: requests per point = max(``--requests``, 2 x clients), ``--requests 8 --max-tokens 32``
gives 8/8/8/16/32 requests for 1/2/4/8/16 clients (72 per mode); with ``--threads 2`` (the servers'
torch threads) the full sweep takes minutes on a 2-core machine, the two server starts included (the
no-batching mode is most of it).
"""

from __future__ import annotations

import argparse
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from semkv.bench.report import line_plot, write_results
from semkv.bench.serve import Outcome, load_tokenizer, warm_local_server
from semkv.bench.serving_mix import WorkItem, build_mix, point_summary, run_item
from semkv.evaluation.essays import essays, haystack, text_of_tokens

log = logging.getLogger(__name__)

MODES = ("no batching", "batching")


def parse_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (each >= 1, increasing)."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--sweep must be comma-separated integers, got {text!r}") from None
    if not counts or any(c < 1 for c in counts) or counts != sorted(set(counts)):
        raise ValueError(f"--sweep must list increasing client counts >= 1, got {text!r}")
    return counts


def requests_for(clients: int, minimum: int) -> int:
    return max(minimum, 2 * clients)


def mix_texts(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """(documents to upload, passages for chat / reworded prompts, long passages), from disjoint essays."""
    tokenizer = load_tokenizer(args)
    names = sorted(essays())
    docs = [text_of_tokens(tokenizer, essays()[n].strip(), args.doc_tokens) for n in names[: args.docs]]
    passage_names = names[args.docs : args.docs + 6]
    passages = [text_of_tokens(tokenizer, essays()[n].strip(), 2 * args.doc_tokens) for n in passage_names]
    start = args.docs + len(passage_names)
    long_passages = [haystack(tokenizer, args.long_tokens, start_essay=start + 3 * i) for i in range(2)]
    return docs, passages, long_passages


def run_load(
    base: str, model: str, items: list[WorkItem], clients: int, max_tokens: int, salt: str
) -> tuple[list[Outcome], list[str], float]:
    """Every item from ``clients`` concurrent clients; (outcomes, their kinds, wall seconds)."""
    with httpx.Client(base_url=base, timeout=600) as client, ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        futures = [
            pool.submit(run_item, client, model, item, i, max_tokens, salt) for i, item in enumerate(items)
        ]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - start
    outcomes = [o for turns in results for o in turns]
    kinds = [item.kind for item, turns in zip(items, results, strict=True) for _ in turns]
    return outcomes, kinds, wall


def sweep_mode(
    args: argparse.Namespace,
    max_running: int,
    counts: list[int],
    texts: tuple[list[str], list[str], list[str]],
) -> dict[int, tuple[dict[str, Any], list[Outcome]]]:
    """One server (fresh home), every client count in order: count -> (summary, outcomes)."""
    docs, passages, long_passages = texts
    flags = ("--max-running", str(max_running), "--max-batched-tokens", str(args.max_batched_tokens))
    sparse = {"sparse": args.sparse_policy, "kv_budget": args.sparse_budget}
    points: dict[int, tuple[dict[str, Any], list[Outcome]]] = {}
    with warm_local_server(args, *flags) as (url, model):
        for clients in tqdm(counts, desc=f"max running {max_running}"):
            salt = f"sweep-{clients}-clients"
            body = {"input": docs, "cache_salt": salt}
            uploaded = httpx.post(f"{url}/v1/documents", json=body, timeout=600).json()["data"]
            ids = [d["id"] for d in uploaded]
            n = requests_for(clients, args.requests)
            items = build_mix(
                n, args.seed + clients, ids, passages, long_passages, args.docs_per_request, sparse
            )
            outcomes, kinds, wall = run_load(url, model, items, clients, args.max_tokens, salt)
            points[clients] = (point_summary(outcomes, kinds, wall), outcomes)
            log.info("max running %d, %d clients: %s", max_running, clients, points[clients][0])
    return points


def sweep_rows(
    counts: list[int], results: dict[str, dict[int, tuple[dict[str, Any], list[Outcome]]]]
) -> list[dict[str, Any]]:
    """One row per client count: both modes' figures side by side and batching / no batching."""
    rows = []
    for clients in counts:
        off, off_outcomes = results["no batching"][clients]
        on, on_outcomes = results["batching"][clients]
        same = sum(a.text == b.text for a, b in zip(off_outcomes, on_outcomes, strict=True))
        row: dict[str, Any] = {"clients": clients, "requests": off["requests"]}
        for key in (
            "output_tokens_per_s",
            "requests_per_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "itl_p50_ms",
            "itl_p99_ms",
        ):
            row[f"off_{key}"] = off[key]
            row[f"on_{key}"] = on[key]
        row["tokens_per_s_ratio"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        row["same_answers"] = same / len(on_outcomes)
        rows.append(row)
    return rows


def plot_sweep(out: str, rows: list[dict[str, Any]]) -> list[str]:
    xs = [r["clients"] for r in rows]

    def series(key: str, name: str = "") -> dict[str, tuple[list[int], list[float]]]:
        return {
            f"{label} {name}".strip(): (xs, [r[f"{prefix}_{key}"] for r in rows])
            for prefix, label in (("off", "no batching (max running 1)"), ("on", "batching"))
        }

    paths = [
        line_plot(
            f"{out}/batching_sweep_tokens_per_s.png",
            series("output_tokens_per_s"),
            "concurrent clients",
            "output tokens / s",
            "Serving mix: output tokens/s",
        ),
        line_plot(
            f"{out}/batching_sweep_ttft.png",
            {**series("ttft_p50_s", "p50"), **series("ttft_p99_s", "p99")},
            "concurrent clients",
            "TTFT (s)",
            "Serving mix: TTFT p50 / p99",
        ),
        line_plot(
            f"{out}/batching_sweep_itl.png",
            {**series("itl_p50_ms", "p50"), **series("itl_p99_ms", "p99")},
            "concurrent clients",
            "inter-token latency (ms)",
            "Serving mix: inter-token latency p50 / p99",
        ),
    ]
    return [str(p) for p in paths]


def run_sweep(args: argparse.Namespace) -> int:
    counts = parse_counts(args.sweep)
    if args.max_tokens < 2 or args.requests < 1:
        raise ValueError("--max-tokens must be >= 2 (inter-token latency) and --requests >= 1")
    texts = mix_texts(args)
    batching = max(args.max_running, counts[-1])
    results = {
        "no batching": sweep_mode(args, 1, counts, texts),
        "batching": sweep_mode(args, batching, counts, texts),
    }
    rows = sweep_rows(counts, results)
    config = {
        k: getattr(args, k)
        for k in (
            "model",
            "sweep",
            "requests",
            "docs",
            "docs_per_request",
            "doc_tokens",
            "long_tokens",
            "max_tokens",
            "max_batched_tokens",
            "sparse_policy",
            "sparse_budget",
            "seed",
            "compute_dtype",
        )
    }
    config.update(max_running=batching, server_threads=args.threads or 1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plots = plot_sweep(args.out, rows)
    by_mode = {mode: {c: summary for c, (summary, _) in points.items()} for mode, points in results.items()}
    notes = (
        "Plots: "
        + ", ".join(plots)
        + "\n\nPaths by kind (batching mode):\n\n"
        + "\n".join(f"- {c} clients: {by_mode['batching'][c]['paths']}" for c in counts)
        + "\n"
    )
    json_path, md_path = write_results(
        args.out,
        "batching_sweep",
        rows,
        config,
        extra={"modes": by_mode, "plots": plots},
        notes=notes,
    )
    log.info("wrote %s and %s", json_path, md_path)
    print(md_path.read_text())  # noqa: T201 - the bench's report on the terminal
    return 0
