"""Runtime overhead vs HF and exact prefix reuse: TTFT, decode speed, KV bytes, disk throughput.

Everything is measured side by side in one run on the same inputs, warm-up excluded:
* our full prefill vs the HF model's own forward on the same token ids (time ratio);
* our decode ms/token vs HF ``generate`` with its own cache, at the same context;
* prefix reuse: a long document asked a second question -> TTFT(full) / TTFT(prefix), answers identical;
* KV bytes per token at rest, and the disk tier's write / read throughput;
* ``--sharing N``: N running sequences whose prompts start with one pooled document — the live KV they
  hold reading it shared against holding copies and against one sequence alone, and a batched decode
  step of the N shared, of the N copies and of one alone.
"""

from __future__ import annotations

import argparse
import gc
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
    p.add_argument(
        "--sharing",
        type=int,
        default=8,
        help="running sequences sharing one pooled document in the sharing rows (0: no sharing rows)",
    )
    p.add_argument("--sharing-tokens", type=int, nargs="+", default=[815, 1600], help="document lengths")


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


def _running(engine, prompts: list[str], reuse: str, steps: int) -> list:
    """Prefilled sequences of ``prompts`` (greedy, nothing stored), live together."""
    return [
        engine.prefill(
            GenerateRequest(
                prompt=p, reuse=reuse, store_prompt=False, stop_at_eos=False, max_new_tokens=steps + 2
            )
        )
        for p in prompts
    ]


def _paired_step_seconds(engine, single: list, batch: list, steps: int) -> tuple[float, float, float]:
    """Median seconds of a decode step of ``single`` and of a batched step of ``batch``, and the median of
    their ratio step by step (batch / single), the two taken in turns (the order flipped every step) so
    that both come from the same moments of a noisy machine; the first two steps of each (arena binding,
    a lone reader copying its prefix in) excluded."""
    times: tuple[list[float], list[float]] = ([], [])
    for step in range(steps + 2):
        for which in (0, 1) if step % 2 else (1, 0):
            start = time.perf_counter()
            engine.decode_batch((single, batch)[which])
            times[which].append(time.perf_counter() - start)
    alone, together = times[0][2:], times[1][2:]
    return median(alone), median(together), median([b / a for a, b in zip(alone, together, strict=True)])


def _live_kv(engine) -> int:
    gc.collect()
    return engine.live_kv_bytes()


def shared_prompt_rows(engine, tokenizer, clients: int, lengths: list[int], steps: int) -> list[dict]:
    """For each document length: ``clients`` sequences whose prompts start with one pooled document
    (each its own question) — live KV and a batched decode step while they read it shared, against the
    same prompts prefilled with no reuse (each holding its copy) and one sequence alone."""
    rows = []
    for length in tqdm(lengths, desc="sharing", leave=False):
        document = haystack(tokenizer, length, start_essay=5)
        prompts = [f"{document}\n\n{QUESTIONS[i % len(QUESTIONS)]} ({i})" for i in range(clients)]
        engine.generate(prompt=document + "\n\n" + QUESTIONS[0], max_new_tokens=1)  # pools the document
        base = _live_kv(engine)
        # room for two phases of steps: one decodes beside the shared readers, then beside the copies
        one = _running(engine, prompts[:1], "none", 2 * steps + 4)
        one_kv = _live_kv(engine) - base
        shared = _running(engine, prompts, "prefix", steps)
        readers = len({id(s.cache.prefix) for s in shared if s.cache.prefix is not None})
        shared_kv = _live_kv(engine) - base - one_kv
        one_step, shared_step, shared_ratio = _paired_step_seconds(engine, one, shared, steps)
        # after the steps as well: a prefix read by a batched step may widen its values then
        shared_kv = max(shared_kv, _live_kv(engine) - base - one_kv)
        still_shared = sum(s.cache.prefix is not None for s in shared)
        del shared
        engine.reclaim_kv()
        copies = _running(engine, prompts, "none", steps)
        copies_kv = _live_kv(engine) - base - one_kv
        _, copies_step, copies_ratio = _paired_step_seconds(engine, one, copies, steps)
        del copies, one
        engine.reclaim_kv()
        rows.append(
            {
                "prompt_tokens": len(engine.layout(plain_request(prompts[0], 1))),
                "clients": clients,
                "prefixes_read": readers,
                "sharing_after_steps": still_shared,
                "live_kv_one_mib": one_kv / 2**20,
                "live_kv_shared_mib": shared_kv / 2**20,
                "live_kv_copies_mib": copies_kv / 2**20,
                "shared_over_one": shared_kv / one_kv,
                "copies_over_one": copies_kv / one_kv,
                "step_one_ms": 1000 * one_step,
                "step_shared_ms": 1000 * shared_step,
                "step_copies_ms": 1000 * copies_step,
                "step_shared_over_one": shared_ratio,  # median of the step-by-step ratios
                "step_copies_over_one": copies_ratio,
            }
        )
    return rows


def print_sharing_rows(rows: list[dict]) -> None:
    for row in rows:
        print(
            f"sharing: {row['clients']} sequences of {row['prompt_tokens']} tokens reading "
            f"{row['prefixes_read']} prefix ({row['sharing_after_steps']} still after the steps): live KV "
            f"{row['live_kv_shared_mib']:.1f} MiB shared = {row['shared_over_one']:.2f}x one "
            f"({row['live_kv_one_mib']:.1f} MiB) vs copies {row['live_kv_copies_mib']:.1f} MiB = "
            f"{row['copies_over_one']:.2f}x; decode step {row['step_shared_ms']:.1f} ms shared "
            f"({row['step_shared_over_one']:.2f}x one's {row['step_one_ms']:.1f} ms, step by step) vs "
            f"{row['step_copies_ms']:.1f} ms copies ({row['step_copies_over_one']:.2f}x)"
        )


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


def _sharing(engine, args: argparse.Namespace) -> list[dict]:
    if args.sharing <= 0:
        return []
    return shared_prompt_rows(engine, engine.tokenizer, args.sharing, args.sharing_tokens, args.decode_tokens)


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
        sharing = _sharing(engine, args)
        summary = {"context_tokens": context_tokens, "threads": torch.get_num_threads()}
        write_results(args.out, "prefix", reuse_rows, config, extra={"summary": summary, "sharing": sharing})
        print_reuse_rows(reuse_rows)
        print_sharing_rows(sharing)
        print(f"results in {args.out}/prefix.json and prefix.md")
        return 0
    progress = tqdm(total=4, desc="bench prefix")
    overhead = runtime_vs_hf(engine, text, args.repeats, args.decode_tokens)
    progress.update()
    reuse_rows = prefix_reuse(engine, document, args.repeats)
    progress.update()
    storage = disk_throughput(engine, text)
    progress.update()
    sharing = _sharing(engine, args)
    progress.update()
    progress.close()
    summary = {**overhead, **storage, "context_tokens": context_tokens, "threads": torch.get_num_threads()}
    notes = "## Runtime vs HF and storage\n\n" + "\n".join(
        f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summary.items()
    )
    write_results(
        args.out, "prefix", reuse_rows, config, extra={"summary": summary, "sharing": sharing}, notes=notes
    )
    print(
        f"prefill ours/HF = {overhead['prefill_ratio_ours_over_hf']:.3f}  "
        f"decode ours/HF = {overhead['decode_ratio_ours_over_hf']:.3f}  "
        f"({overhead['decode_ours_ms_per_token']:.1f} vs {overhead['decode_hf_ms_per_token']:.1f} ms/token)"
    )
    print_reuse_rows(reuse_rows)
    print_sharing_rows(sharing)
    print(
        f"KV {summary['kv_bytes_per_token']:.0f} B/token; disk write {summary['disk_write_MBps']:.0f} MB/s, "
        f"read {summary['disk_read_MBps']:.0f} MB/s"
    )
    print(f"results in {args.out}/prefix.json and prefix.md")
    return 0
