"""Continuous batching: ``semkv bench batching`` runs the RAG load of ``semkv bench serve`` against a server decoding one request at a time
(``--max-running 1``) and one batching up to ``--max-running`` sequences, in one run.

Each mode starts a fresh ``semkv serve`` (fresh home, full prefill: ``reuse="none"``, nothing stored, so
both modes do the same model work), warms it up, and sends the requests from ``--clients`` concurrent
streaming clients. Reported per mode: requests/s, output tokens/s, client-side TTFT p50/p95/p99,
user-visible decode ms/token (first streamed text to last, over the tokens after the first; queueing
behind other requests' prefills included), and whether each answer equals the one-at-a-time answer.
Then, in process, the decode step time at batch 1 / 4 / 8 over prompts of the workload's length:
one ``decode_batch`` of B sequences against B one-sequence steps.

``--sweep 1,2,4,8,16``: the serving mix from each number of concurrent clients, batching on vs off
(:mod:`semkv.bench.batching_sweep`). ``--long-prompt-tokens 7900``: a short request arriving while a
long prompt is prefilled, chunked prefill vs none (:mod:`semkv.bench.batching_long`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

from semkv.bench import serve
from semkv.bench.report import write_results
from semkv.bench.serve import Outcome, build_workload, percentile, run_mode, warm_local_server
from semkv.config import default_home
from semkv.request import GenerateRequest

log = logging.getLogger(__name__)

STEP_BATCHES = (1, 4, 8)
STEP_REPEATS = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve.add_arguments(p)
    p.add_argument("--max-running", type=int, default=8, help="the batched server's --max-running")
    p.add_argument(
        "--sweep",
        default=None,
        metavar="N,N,...",
        help="sweep these numbers of concurrent clients over the serving mix, batching on and off "
        "(see semkv.bench.batching_sweep)",
    )
    p.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=0,
        help="the long-prompt scenario: a short request arriving while a prompt of this many tokens is "
        "prefilled, chunked prefill vs none (see semkv.bench.batching_long)",
    )
    p.add_argument(
        "--max-batched-tokens", type=int, default=512, help="the servers' --max-batched-tokens (sweep)"
    )
    p.add_argument(
        "--chunk-sizes",
        default="256,512",
        help="long-prompt scenario: the chunked servers' --max-batched-tokens, comma-separated",
    )
    p.add_argument(
        "--short-delay",
        type=float,
        default=1.0,
        help="long-prompt scenario: seconds from the long request to the short",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="long-prompt scenario: long+short pairs per server; shared-document scenario: bursts per server",
    )
    p.add_argument(
        "--long-tokens",
        type=int,
        default=2048,
        help="sweep: tokens of the mix's long (sparse-decoded) prompts",
    )
    p.add_argument(
        "--sparse-policy", default="quest", help="sweep: the long prompts' sparse policy (set per request)"
    )
    p.add_argument("--sparse-budget", type=float, default=0.1, help="sweep: the long prompts' kv_budget")
    p.add_argument(
        "--shared-burst",
        type=int,
        default=0,
        metavar="N",
        help="the shared-document scenario: N clients at once asking about one document, batching on and "
        "off (see semkv.bench.batching_shared)",
    )
    p.add_argument(
        "--shared-doc-tokens", type=int, default=1500, help="shared-document scenario: the document's tokens"
    )


def batching_row(label: str, outcomes: list[Outcome], wall_s: float, reference: list[Outcome] | None) -> dict:
    ttfts = [o.ttft_s for o in outcomes]
    tokens = [int(o.stats.get("generated_tokens", 0)) for o in outcomes]
    per_token = [
        1000 * (o.latency_s - o.ttft_s) / (n - 1) for o, n in zip(outcomes, tokens, strict=True) if n > 1
    ]
    row: dict[str, Any] = {
        "mode": label,
        "requests": len(outcomes),
        "requests_per_s": len(outcomes) / wall_s,
        "output_tokens_per_s": sum(tokens) / wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_p99_s": percentile(ttfts, 99),
        "decode_ms_per_token_p50": percentile(per_token, 50),
        "decode_ms_per_token_p95": percentile(per_token, 95),
        "wall_s": wall_s,
    }
    if reference is not None:
        row["same_answer_as_one_at_a_time"] = sum(
            o.text == r.text for o, r in zip(outcomes, reference, strict=True)
        ) / len(outcomes)
    return row


def serve_mode(
    args: argparse.Namespace, max_running: int, payloads: list[tuple[dict[str, Any], str]]
) -> tuple[list[Outcome], float]:
    with warm_local_server(args, "--max-running", str(max_running)) as (url, model):
        return run_mode(url, model, args, payloads)


def decode_step_times(args: argparse.Namespace, docs: list[str], question: str) -> list[dict[str, Any]]:
    """Median decode step ms at each batch size: one batched step vs B one-sequence steps."""
    from semkv.engine import Engine

    models_dir = args.models_dir or str(default_home() / "models")  # the converted model, not a new copy
    engine = Engine.from_args(args, home=args.step_home, models_dir=models_dir)
    request = GenerateRequest(
        messages=[{"role": "user", "content": question}],
        chunks=docs[: args.docs_per_request],
        reuse="none",
        store_prompt=False,
        max_new_tokens=2 * STEP_REPEATS + 4,
        stop_at_eos=False,
    )
    rows = []
    for batch in STEP_BATCHES:
        seqs = [engine.prefill(request) for _ in range(batch)]
        engine.decode_batch(seqs)  # warm
        batched, serial = [], []
        for _ in range(STEP_REPEATS // 2):
            start = time.perf_counter()
            engine.decode_batch(seqs)
            batched.append(time.perf_counter() - start)
            start = time.perf_counter()
            for seq in seqs:
                engine.decode_step(seq)
            serial.append(time.perf_counter() - start)
        rows.append(
            {
                "batch": batch,
                "context_tokens": seqs[0].prompt_tokens,
                "batched_step_ms": 1000 * statistics.median(batched),
                "serial_steps_ms": 1000 * statistics.median(serial),
                "batched_ms_per_sequence": 1000 * statistics.median(batched) / batch,
            }
        )
    engine.close()
    base = rows[0]["batched_step_ms"]
    for row in rows:
        row["step_cost_vs_batch_1"] = row["batched_step_ms"] / base
    return rows


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    torch.set_num_threads(args.threads or 1)
    if args.sweep:
        from semkv.bench.batching_sweep import run_sweep

        return run_sweep(args)
    if args.long_prompt_tokens:
        from semkv.bench.batching_long import run_long_prompt

        return run_long_prompt(args)
    if args.shared_burst:
        from semkv.bench.batching_shared import run_shared_burst

        return run_shared_burst(args)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1 or args.max_running < 2:
        raise ValueError("--clients, --requests, --max-tokens must be >= 1 and --max-running >= 2")

    docs, requests = build_workload(args)
    payloads = [
        ({"chunks": [docs[i] for i in idx], "reuse": "none", "store_prompt": False}, q) for idx, q in requests
    ]
    serial, serial_wall = serve_mode(args, 1, payloads)
    batched, batched_wall = serve_mode(args, args.max_running, payloads)
    rows = [
        batching_row("one at a time (max running 1)", serial, serial_wall, None),
        batching_row(f"batched (max running {args.max_running})", batched, batched_wall, serial),
    ]
    with tempfile.TemporaryDirectory(prefix="semkv-bench-steps-") as step_home:
        args.step_home = step_home
        steps = decode_step_times(args, docs, requests[0][1])
    one, many = rows
    ratios = {
        "requests_per_s": many["requests_per_s"] / one["requests_per_s"],
        "output_tokens_per_s": many["output_tokens_per_s"] / one["output_tokens_per_s"],
        "ttft_p50": many["ttft_p50_s"] / one["ttft_p50_s"],
        "ttft_p95": many["ttft_p95_s"] / one["ttft_p95_s"],
        "decode_ms_per_token_p50": many["decode_ms_per_token_p50"] / one["decode_ms_per_token_p50"],
    }
    config = {
        k: getattr(args, k)
        for k in ("model", "clients", "requests", "docs_per_request", "doc_tokens", "max_tokens", "seed")
    }
    config.update(max_running=args.max_running, compute_dtype=args.compute_dtype, threads=args.threads or 1)
    step_lines = "\n".join(
        f"| {r['batch']} | {r['context_tokens']} | {r['batched_step_ms']:.1f} | {r['serial_steps_ms']:.1f} | "
        f"{r['step_cost_vs_batch_1']:.2f} |"
        for r in steps
    )
    notes = (
        f"batched / one at a time: requests/s x{ratios['requests_per_s']:.2f}, output tokens/s "
        f"x{ratios['output_tokens_per_s']:.2f}, TTFT p50 x{ratios['ttft_p50']:.2f}, p95 x{ratios['ttft_p95']:.2f}, "
        f"decode ms/token p50 x{ratios['decode_ms_per_token_p50']:.2f}; answers identical: "
        f"{many['same_answer_as_one_at_a_time']:.0%}.\n\n"
        "Decode step (in process, median of "
        f"{STEP_REPEATS // 2}):\n\n| batch | context | one batched step ms | B single steps ms | "
        f"batched step / batch-1 step |\n|---|---|---|---|---|\n{step_lines}\n"
    )
    json_path, md_path = write_results(
        args.out,
        "batching",
        rows,
        config,
        extra={"ratios": ratios, "decode_steps": steps, "answers": {"serial": [o.text for o in serial]}},
        notes=notes,
    )
    log.info("wrote %s and %s", json_path, md_path)
    print(md_path.read_text())  # noqa: T201 - the bench's report on the terminal
    return 0
