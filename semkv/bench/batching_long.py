"""``semkv bench batching --long-prompt-tokens 7900``: a short request arriving while a long prompt is prefilled.

What it shows: the short request's TTFT with chunked prefill, against the whole long prefill without
it. One server per configuration, each with a fresh home: chunked prefill with
``--max-batched-tokens`` = each of ``--chunk-sizes``, and ``--no-chunked-prefill``. On each, after the
same warm-up, ``--repeats`` times: one streaming request with a prompt of ``--long-prompt-tokens``
tokens (essays, a different cut each repeat, chat template applied by the server), then after
``--short-delay`` s a short streaming request. Both use ``reuse="none"`` and ``store_prompt=False`` (no
request reuses another's KV, so the repeats are alike). Reported per configuration (medians over the
repeats): the short request's TTFT and end-to-end latency, the long request's TTFT and its server-side
prefill time. SmolLM2 has 8192 positions: keep prompt + template + new tokens under it.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Any

import httpx

from semkv.bench.report import median, write_results
from semkv.bench.serve import Outcome, load_tokenizer, stream_chat, warm_local_server
from semkv.evaluation.essays import haystack

log = logging.getLogger(__name__)

SHORT_QUESTION = "In one sentence: why do people start companies?"
LONG_QUESTION = "What are the recurring themes across these essays?"
TARGET_SHORT_TTFT_S = 1.5


def server_configs(chunk_sizes: str) -> list[tuple[str, list[str]]]:
    """(label, extra ``semkv serve`` flags) per configuration: chunked at each size, then unchunked."""
    try:
        sizes = [int(s) for s in chunk_sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--chunk-sizes must be comma-separated integers, got {chunk_sizes!r}") from None
    if not sizes or any(s < 16 for s in sizes):
        raise ValueError(f"--chunk-sizes must list sizes >= 16, got {chunk_sizes!r}")
    configs = [(f"chunked prefill, {s}-token steps", ["--max-batched-tokens", str(s)]) for s in sizes]
    return [*configs, ("no chunked prefill", ["--no-chunked-prefill"])]


def body(model: str, text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "semkv": {"reuse": "none", "store_prompt": False},
    }


def long_and_short(
    base: str, model: str, long_text: str, delay_s: float, max_tokens: int
) -> tuple[Outcome, Outcome]:
    """The long request, then ``delay_s`` later the short one (each on its own connection)."""
    result: dict[str, Outcome] = {}

    def send_long() -> None:
        with httpx.Client(base_url=base, timeout=600) as client:
            result["long"] = stream_chat(client, body(model, long_text, max_tokens), 0)

    thread = threading.Thread(target=send_long)
    thread.start()
    time.sleep(delay_s)
    with httpx.Client(base_url=base, timeout=600) as client:
        short = stream_chat(client, body(model, SHORT_QUESTION, max_tokens), 1)
    thread.join()
    return result["long"], short


def run_config(
    args: argparse.Namespace, label: str, flags: list[str], long_texts: list[str]
) -> dict[str, Any]:
    pairs: list[tuple[Outcome, Outcome]] = []
    with warm_local_server(args, *flags) as (url, model):
        for text in long_texts:
            pairs.append(long_and_short(url, model, text, args.short_delay, args.max_tokens))
            log.info(
                "%s: long TTFT %.2f s, short TTFT %.2f s", label, pairs[-1][0].ttft_s, pairs[-1][1].ttft_s
            )
    return {
        "server": label,
        "short_ttft_s": median([s.ttft_s for _, s in pairs]),
        "short_ttft_max_s": max(s.ttft_s for _, s in pairs),
        "short_latency_s": median([s.latency_s for _, s in pairs]),
        "long_ttft_s": median([lo.ttft_s for lo, _ in pairs]),
        "long_server_prefill_s": median([float(lo.stats.get("ttft_s", float("nan"))) for lo, _ in pairs]),
        "long_prompt_tokens": int(pairs[0][0].stats.get("prompt_tokens", 0)),
        "short_ttft_all_s": " ".join(f"{s.ttft_s:.2f}" for _, s in pairs),
    }


def run_long_prompt(args: argparse.Namespace) -> int:
    if args.long_prompt_tokens + args.max_tokens + 64 > 8192:
        log.warning("a %d-token prompt may not fit a model of 8192 positions", args.long_prompt_tokens)
    if args.repeats < 1 or args.short_delay < 0:
        raise ValueError("--repeats must be >= 1 and --short-delay >= 0")
    tokenizer = load_tokenizer(args)
    long_texts = [
        f"{haystack(tokenizer, args.long_prompt_tokens - 32, start_essay=7 * r)}\n\n{LONG_QUESTION}"
        for r in range(args.repeats)
    ]
    rows = [run_config(args, label, flags, long_texts) for label, flags in server_configs(args.chunk_sizes)]
    config = {
        k: getattr(args, k)
        for k in (
            "model",
            "long_prompt_tokens",
            "chunk_sizes",
            "short_delay",
            "repeats",
            "max_tokens",
            "seed",
        )
    }
    config.update(compute_dtype=args.compute_dtype, server_threads=args.threads or 1)
    unchunked = rows[-1]
    lines = [
        f"- {r['server']}: short request TTFT {r['short_ttft_s']:.2f} s "
        f"({'meets' if r['short_ttft_s'] <= TARGET_SHORT_TTFT_S else 'misses'} the {TARGET_SHORT_TTFT_S} s target), "
        f"x{r['short_ttft_s'] / unchunked['short_ttft_s']:.2f} of the unchunked server's; "
        f"long TTFT {r['long_ttft_s']:.2f} s"
        for r in rows
    ]
    notes = "\n".join(lines) + "\n"
    json_path, md_path = write_results(args.out, "batching_long_prompt", rows, config, notes=notes)
    log.info("wrote %s and %s", json_path, md_path)
    print(md_path.read_text())  # noqa: T201 - the bench's report on the terminal
    return 0
