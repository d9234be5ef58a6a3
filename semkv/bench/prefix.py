"""Runtime overhead vs HF and exact prefix reuse: TTFT, decode speed, KV bytes, disk throughput.

Everything is measured side by side in one run on the same inputs, warm-up excluded:
* our full prefill vs the HF model's own forward on the same token ids (time ratio);
* our decode ms/token vs HF ``generate`` with its own cache, at the same context;
* prefix reuse: a long document asked a second question -> TTFT(full) / TTFT(prefix), answers identical;
* KV bytes per token at rest, and the disk tier's write / read throughput.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from semkv.bench.report import median, write_results
from semkv.evaluation.essays import haystack
from semkv.request import GenerateRequest
from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKind, chunk_key
from semkv.store.tiers import DiskTier

QUESTIONS = [
    "What is the main argument of the text above? Answer in one sentence.",
    "Name one example the author gives. Answer briefly.",
    "What advice does the author give? Answer briefly.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-tokens", type=int, default=2048, help="document length for all measurements")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median reported)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument(
        "--reuse-only",
        action="store_true",
        help="only the prefix-reuse rows (full prefill, pool hit, store hit, copy and step floors)",
    )


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def plain_request(text: str, max_new_tokens: int) -> GenerateRequest:
    """Full prefill of plain ``text`` (no template), greedy, fixed length, nothing stored."""
    return GenerateRequest(
        prompt=text,
        use_chat_template=False,
        reuse="none",
        store_prompt=False,
        stop_at_eos=False,
        max_new_tokens=max_new_tokens,
    )


@torch.inference_mode()
def runtime_vs_hf(engine, text: str, repeats: int, decode_tokens: int) -> dict[str, float]:
    """Prefill and decode time of our engine's steps vs the HF model on the same ids (interleaved repeats)."""
    model = engine.hf_model
    request = plain_request(text, decode_tokens)
    tensor = torch.tensor([engine.layout(request).token_ids])
    ours_prefill, hf_prefill = [], []
    model(tensor[:, :64])  # warm-up
    engine.prefill(plain_request(text[:200], 1))
    for _ in range(repeats):
        ours_prefill.append(engine.prefill(request).ttft_s)
        hf_prefill += _timed(lambda: model(tensor), 1)

    def hf_decode() -> float:
        start = time.perf_counter()
        model.generate(tensor, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(
            tensor,
            max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return (time.perf_counter() - start - first) / (decode_tokens - 1)

    def ours_decode() -> float:
        seq = engine.prefill(request)
        engine.decode(seq)
        return seq.decode_s / (decode_tokens - 1)

    hf_dec, ours_dec = [], []
    for _ in range(max(1, repeats // 2)):
        hf_dec.append(hf_decode())
        ours_dec.append(ours_decode())
    return {
        "prefill_ours_s": median(ours_prefill),
        "prefill_hf_s": median(hf_prefill),
        "prefill_ratio_ours_over_hf": median(ours_prefill) / median(hf_prefill),
        "decode_ours_ms_per_token": 1000 * median(ours_dec),
        "decode_hf_ms_per_token": 1000 * median(hf_dec),
        "decode_ratio_ours_over_hf": median(ours_dec) / median(hf_dec),
    }


def copy_seconds(num_bytes: int, repeats: int) -> float:
    """Median seconds of one copy of ``num_bytes`` between two host buffers (what moving a hit's reused
    KV once costs: the floor a hit that copies its rows can reach)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device="cpu")
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    times = []
    for _ in range(max(3, repeats)):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return median(times)


def prefix_reuse(engine, document: str, repeats: int) -> list[dict]:
    """TTFT of full prefill vs prefix reuse for follow-up questions on one document — a hit on the page
    pool (the default hot tier) and the same hit from the store's memory tier (pool emptied) — and next
    to the pool hit: one copy of the KV bytes it reuses (in the live cache's format) and one decode step
    at that length, measured in the same run (the hit's cost beyond a decode step, in copies of its
    bytes)."""
    rows = []
    for question in tqdm(QUESTIONS[1:], desc="prefix reuse", leave=False):
        prompt = document + "\n\n" + question
        # stores the document's blocks (store and pool)
        engine.generate(prompt=document + "\n\n" + QUESTIONS[0], max_new_tokens=1)
        full, reused = [], []
        for _ in range(repeats):
            full.append(engine.generate(prompt=prompt, max_new_tokens=24, reuse="none", store_prompt=False))
            reused.append(
                engine.generate(prompt=prompt, max_new_tokens=24, reuse="prefix", store_prompt=False)
            )
        engine.drop_page_pool()
        from_store = [
            engine.generate(prompt=prompt, max_new_tokens=1, reuse="prefix", store_prompt=False)
            for _ in range(repeats)
        ]
        ttft_full = median([g.stats["ttft_s"] for g in full])
        ttft_prefix = median([g.stats["ttft_s"] for g in reused])
        ttft_store = median([g.stats["ttft_s"] for g in from_store])
        reused_bytes = reused[0].stats["reused_tokens"] * engine.kv_bytes_per_token()
        copy_s = copy_seconds(reused_bytes, repeats)
        step_s = median([g.stats["decode_ms_per_token"] / 1000 for g in reused])
        rows.append(
            {
                "question": question,
                "prompt_tokens": full[0].stats["prompt_tokens"],
                "reused_tokens": reused[0].stats["reused_tokens"],
                "pooled_blocks": reused[0].stats.get("pooled_blocks", 0),
                "ttft_full_s": ttft_full,
                "ttft_prefix_s": ttft_prefix,
                "speedup": ttft_full / ttft_prefix,
                "ttft_prefix_from_store_s": ttft_store,
                "speedup_from_store": ttft_full / ttft_store,
                "reused_kv_mib": reused_bytes / 2**20,
                "copy_s": copy_s,
                "decode_step_s": step_s,
                "hit_beyond_step_over_copy": (ttft_prefix - step_s) / copy_s,
                "answers_identical": all(
                    f.token_ids == r.token_ids for f, r in zip(full, reused, strict=True)
                ),
                "answer": reused[0].text,
            }
        )
    return rows


def print_reuse_rows(rows: list[dict]) -> None:
    for row in rows:
        print(
            f"prefix reuse: {row['prompt_tokens']} tokens, TTFT {row['ttft_full_s']:.3f}s -> "
            f"{row['ttft_prefix_s']:.4f}s pooled ({row['speedup']:.1f}x, {row['pooled_blocks']} pages), "
            f"{row['ttft_prefix_from_store_s']:.4f}s from the store ({row['speedup_from_store']:.1f}x), "
            f"identical={row['answers_identical']}; one copy of its {row['reused_kv_mib']:.0f} MiB "
            f"{1000 * row['copy_s']:.1f} ms, one decode step {1000 * row['decode_step_s']:.1f} ms: "
            f"hit - step = {row['hit_beyond_step_over_copy']:.1f} copies"
        )


def disk_throughput(engine, text: str) -> dict[str, float]:
    """Write and read the KV of ``text`` as 64-token entries through a fresh disk tier."""
    seq = engine.prefill(plain_request(text, 1))
    cache, ids = seq.cache, seq.layout.token_ids
    entries = []
    for start in range(0, len(ids) - 63, 64):
        k, v = cache.export(start, start + 64)
        tokens = ids[start : start + 64]
        entries.append(
            KVEntry(chunk_key(engine.fingerprint, tokens), EntryKind.CHUNK, engine.fingerprint, tokens, k, v)
        )
    folder = Path(tempfile.mkdtemp(prefix="semkv-disk-bench-"))
    try:
        tier = DiskTier(folder)
        start = time.perf_counter()
        for e in entries:
            tier.put(e)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for e in entries:
            assert tier.get(e.key) is not None
        read_s = time.perf_counter() - start
        total = tier.stats.bytes_written
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "kv_bytes_per_token": cache.nbytes() / cache.length,
        "disk_entries": len(entries),
        "disk_write_MBps": total / write_s / 1e6,
        "disk_read_MBps": total / read_s / 1e6,
    }


def run(args: argparse.Namespace) -> int:
    from semkv.config import StoreConfig
    from semkv.engine import Engine

    # memory-only store: earlier runs cannot pre-warm the measurement
    engine = Engine.from_args(args, store=StoreConfig(disk=False))
    tokenizer = engine.tokenizer
    document = haystack(tokenizer, args.context_tokens - 120, start_essay=3)
    text = haystack(tokenizer, args.context_tokens)
    context_tokens = len(engine.layout(plain_request(text, 1)))
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")}
    if args.reuse_only:
        reuse_rows = prefix_reuse(engine, document, args.repeats)
        summary = {"context_tokens": context_tokens, "threads": torch.get_num_threads()}
        write_results(args.out, "prefix", reuse_rows, config, extra={"summary": summary})
        print_reuse_rows(reuse_rows)
        print(f"results in {args.out}/prefix.json and prefix.md")
        return 0
    progress = tqdm(total=3, desc="bench prefix")
    overhead = runtime_vs_hf(engine, text, args.repeats, args.decode_tokens)
    progress.update()
    reuse_rows = prefix_reuse(engine, document, args.repeats)
    progress.update()
    storage = disk_throughput(engine, text)
    progress.update()
    progress.close()
    summary = {**overhead, **storage, "context_tokens": context_tokens, "threads": torch.get_num_threads()}
    notes = "## Runtime vs HF and storage\n\n" + "\n".join(
        f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summary.items()
    )
    write_results(args.out, "prefix", reuse_rows, config, extra={"summary": summary}, notes=notes)
    print(
        f"prefill ours/HF = {overhead['prefill_ratio_ours_over_hf']:.3f}  "
        f"decode ours/HF = {overhead['decode_ratio_ours_over_hf']:.3f}  "
        f"({overhead['decode_ours_ms_per_token']:.1f} vs {overhead['decode_hf_ms_per_token']:.1f} ms/token)"
    )
    print_reuse_rows(reuse_rows)
    print(
        f"KV {summary['kv_bytes_per_token']:.0f} B/token; disk write {summary['disk_write_MBps']:.0f} MB/s, "
        f"read {summary['disk_read_MBps']:.0f} MB/s"
    )
    print(f"results in {args.out}/prefix.json and prefix.md")
    return 0
