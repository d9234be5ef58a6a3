"""``semkv bench batching --shared-burst 8``: a burst of requests that start with the same long document.

Many users asking about one document at once (a shared system prompt, a contract, a manual) send
prompts whose first ~``--shared-doc-tokens`` tokens are equal. The batching scheduler prefills a long
prompt while the others wait (:meth:`semkv.scheduler.Scheduler._admit`); once it is stored they load
its blocks as a prefix hit and compute only their questions.

Two servers, each with a fresh home: batching (``--max-running`` = max(N, ``--max-running``)) and
batching off (``--max-running 1``). On each, after the same warm-up, ``--repeats`` bursts: N streaming
clients at once, each the document (chat template, user turn) + a different question, greedy,
``--max-tokens`` new tokens; every burst in a cache namespace of its own (``cache_salt``), so nothing
one burst stored is reused by the next. Reported per server (over all bursts): wall seconds per burst
(median), output tokens/s, TTFT p50/p99, prompt tokens the model computed per burst (the engine's
``recomputed_tokens``), and the answers equal between the servers (bf16 rounding may differ between
batched and single decode steps).
"""

from __future__ import annotations

import argparse
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from semkv.bench.report import median, write_results
from semkv.bench.serve import Outcome, load_tokenizer, percentile, stream_chat, warm_local_server
from semkv.evaluation.essays import essays, text_of_tokens

log = logging.getLogger(__name__)

QUESTIONS = [
    "What is the main argument of this essay?",
    "Name one piece of advice the author gives.",
    "Who is the essay written for?",
    "Which example does the author use first?",
    "What would a critic of this essay say?",
    "Suggest a new title for the essay.",
    "What is the tone of the essay?",
    "List two claims the author makes.",
    "What does the author conclude?",
    "Which idea in the essay is the weakest?",
    "What should a reader do after reading this?",
    "Is the author optimistic? Why?",
    "Summarize the first paragraph.",
    "What surprised you in this essay?",
    "Which sentence best sums up the essay?",
    "What question does the essay leave open?",
]
MODES = ("batching", "no batching")


def burst(base: str, model: str, document: str, clients: int, max_tokens: int, salt: str) -> list[Outcome]:
    """``clients`` streaming requests at once: the document and question i each."""
    bodies = [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"{document}\n\n{QUESTIONS[i % len(QUESTIONS)]}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "cache_salt": salt,
        }
        for i in range(clients)
    ]
    with httpx.Client(base_url=base, timeout=600) as client, ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda ib: stream_chat(client, ib[1], ib[0]), enumerate(bodies)))


def run_server(
    args: argparse.Namespace, label: str, max_running: int, document: str
) -> tuple[dict[str, Any], list[list[Outcome]]]:
    """One server (fresh home), ``--repeats`` bursts: its row and the bursts' outcomes."""
    clients = args.shared_burst
    flags = ("--max-running", str(max_running), "--max-batched-tokens", str(args.max_batched_tokens))
    bursts: list[list[Outcome]] = []
    walls: list[float] = []
    with warm_local_server(args, *flags) as (url, model):
        for r in range(args.repeats):
            start = time.perf_counter()
            bursts.append(burst(url, model, document, clients, args.max_tokens, f"burst-{r}"))
            walls.append(time.perf_counter() - start)
            log.info("%s, burst %d: %.2f s", label, r, walls[-1])
    outcomes = [o for b in bursts for o in b]
    tokens = sum(int(o.stats.get("generated_tokens", 0)) for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes]
    row = {
        "server": label,
        "max_running": max_running,
        "burst_wall_s": median(walls),
        "output_tokens_per_s": tokens / sum(walls),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "computed_prompt_tokens_per_burst": sum(int(o.stats.get("recomputed_tokens", 0)) for o in outcomes)
        / len(bursts),
        "reused_prompt_tokens_per_burst": sum(int(o.stats.get("reused_tokens", 0)) for o in outcomes)
        / len(bursts),
    }
    return row, bursts


def run_shared_burst(args: argparse.Namespace) -> int:
    if args.shared_burst < 2 or args.repeats < 1 or args.max_tokens < 1:
        raise ValueError("--shared-burst must be >= 2, --repeats and --max-tokens >= 1")
    if args.shared_doc_tokens < 256:
        raise ValueError(f"--shared-doc-tokens must be >= 256, got {args.shared_doc_tokens}")
    tokenizer = load_tokenizer(args)
    document = text_of_tokens(tokenizer, essays()[sorted(essays())[3]].strip(), args.shared_doc_tokens)
    batching = max(args.shared_burst, args.max_running)
    results = [run_server(args, label, n, document) for label, n in zip(MODES, (batching, 1), strict=True)]
    rows = [row for row, _ in results]
    batched, serial = (bursts for _, bursts in results)
    pairs = [(a, b) for bb, sb in zip(batched, serial, strict=True) for a, b in zip(bb, sb, strict=True)]
    rows[0]["same_answers"] = sum(a.text == b.text for a, b in pairs) / len(pairs)
    config = {
        k: getattr(args, k)
        for k in ("model", "shared_burst", "shared_doc_tokens", "repeats", "max_tokens", "max_batched_tokens")
    }
    config.update(compute_dtype=args.compute_dtype, server_threads=args.threads or 1)
    on, off = rows
    speedup = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    computed = f"{on['computed_prompt_tokens_per_burst']:.0f} / {off['computed_prompt_tokens_per_burst']:.0f}"
    notes = (
        f"Batching / batching off: output tokens/s x{speedup:.2f}, TTFT p50 {on['ttft_p50_s']:.2f} / "
        f"{off['ttft_p50_s']:.2f} s, p99 {on['ttft_p99_s']:.2f} / {off['ttft_p99_s']:.2f} s, prompt tokens"
        f" computed per burst {computed}; answers equal {on['same_answers']:.0%}.\n"
    )
    json_path, md_path = write_results(args.out, "batching_shared_burst", rows, config, notes=notes)
    log.info("wrote %s and %s", json_path, md_path)
    print(md_path.read_text())  # noqa: T201 - the bench's report on the terminal
    return 0
