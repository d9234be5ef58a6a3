"""Sparse decode on pass keys hidden in ACL papers (``semkv bench sparse --suite paperkeys``).

A held-out check of the sparse defaults in prose other than the bench's haystacks (Paul Graham essays):
the full text of ACL papers from ``aclsum`` (its train split by default; the share bench reads its test
split), several papers back to back up to ``--lengths`` tokens, with one verification number standing
as its own paragraph at a depth spread over (0.05, 0.95), asked in a wording not used elsewhere in the
bench, sent as users send it (the chat template, the answer's lead-in opening the reply). Seeded.

Per case: dense decoding and every ``--policies`` label at ``--budgets`` decode greedily from forks of one
prefilled sequence (correct = the number in the answer), and ``sparse="auto"`` (what the engine's profile,
shipped or the user's, chooses for this prompt) runs as whole requests against whole dense requests,
interleaved (the order alternates per case), so its request time counts everything auto adds (the
prompt's queries captured at prefill, block summaries, selection). Per-case results go to
``<out>/<name>_cases.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from semkv.bench.report import median, write_results
from semkv.evaluation.metrics import exact_match, paired_speedup
from semkv.evaluation.papers import full_text_sentences, load_papers
from semkv.request import GenerateRequest

INSTRUCTION = (
    "Below are several scientific papers, one after another. An editor left one verification number "
    "somewhere in them. Read everything carefully: afterwards you will be asked for that number."
)
QUESTION = "What is the verification number the editor left in the papers above? Give only the number."
LEAD_IN = "The verification number is"
NEEDLE = "Editor's note: the verification number of this collection is {answer}. Keep it in mind."
OVERHEAD_TOKENS = 120  # instruction, question, template and needle


@dataclass
class PaperKeyCase:
    """One case: chat messages whose user turn holds the papers, the needle and the question.

    depth: the needle's position as a fraction of the papers' sentences; papers: the aclsum ids used.
    """

    index: int
    length: int
    depth: float
    answer: str
    user: str
    papers: list[str]

    def options(self, max_new_tokens: int, **fields: Any) -> dict[str, Any]:
        """The :class:`GenerateRequest` fields of the case (greedy, not stored, no reuse)."""
        return dict(
            messages=[{"role": "user", "content": self.user}],
            assistant_prefix=LEAD_IN,
            use_chat_template=True,
            max_new_tokens=max_new_tokens,
            stop_at_eos=True,
            store_prompt=False,
            reuse="none",
            **fields,
        )


def _paper_order(split: str, seed: int) -> list[str]:
    ids = [p["id"] for p in load_papers(split)]
    random.Random(seed).shuffle(ids)
    return ids


def make_cases(tokenizer, length: int, count: int, seed: int = 0, split: str = "train") -> list[PaperKeyCase]:
    """``count`` cases of about ``length`` prompt tokens; depths spread evenly over (0.05, 0.95), in an
    order that is not the index order; papers differ from case to case (taken in a seeded order)."""
    order = _paper_order(split, seed)
    cursor, cases = 0, []
    for i in range(count):
        rng = random.Random(seed * 1_000_003 + length * 101 + i)
        depth = 0.05 + 0.9 * ((i * 5) % count + 0.5) / count
        sentences: list[str] = []
        papers: list[str] = []
        total, budget = 0, length - OVERHEAD_TOKENS
        while total < budget:
            paper = order[cursor % len(order)]
            cursor += 1
            papers.append(paper)
            for sentence in full_text_sentences(paper):
                n = len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
                if total + n > budget:
                    total = budget
                    break
                sentences.append(sentence)
                total += n
        answer = str(rng.randrange(100_000, 1_000_000))
        at = max(1, min(len(sentences) - 1, round(depth * len(sentences))))
        body = (
            " ".join(sentences[:at])
            + "\n\n"
            + NEEDLE.format(answer=answer)
            + "\n\n"
            + " ".join(sentences[at:])
        )
        user = f"{INSTRUCTION}\n\n{body}\n\n{QUESTION}"
        cases.append(PaperKeyCase(i, length, depth, answer, user, papers))
    return cases


def decode_fork(engine, base, decoder, max_steps: int) -> tuple[str, list[float]]:
    """Greedy decode from a fork of ``base`` until EOS or ``max_steps``; (text, per-step seconds)."""
    seq = engine.fork(base, sparse=decoder)
    step_s = []
    while not seq.finished and len(step_s) < max_steps:
        start = time.perf_counter()
        engine.decode_step(seq)
        step_s.append(time.perf_counter() - start)
    if decoder is not None:
        decoder.finish()
    return engine.tokenizer.decode(seq.output_ids(), skip_special_tokens=True), step_s


def run_case(engine, case: PaperKeyCase, args: argparse.Namespace, configs, make_decoder) -> dict[str, Any]:
    """Forks for dense and every config; whole requests for dense and auto. One JSON-able record."""
    runs: dict[str, Any] = {}
    request = GenerateRequest(**case.options(args.paper_new_tokens, sparse=None))
    base = engine.prefill(request, capture_queries=True)
    text, step_s = decode_fork(engine, base, None, args.paper_new_tokens - 1)
    runs["dense"] = {"text": text, "ok": exact_match(text, case.answer), "ms": 1000 * median(step_s)}
    for label, budget, options in configs:
        decoder = make_decoder(engine, label, budget, options)
        text, step_s = decode_fork(engine, base, decoder, args.paper_new_tokens - 1)
        runs[f"{label}@{budget}"] = {
            "text": text,
            "ok": exact_match(text, case.answer),
            "ms": 1000 * median(step_s),
            "blocks_per_step": decoder.stats().get("blocks_selected_per_step"),
        }
    requests: dict[str, Any] = {}
    order = ("dense", "auto") if case.index % 2 == 0 else ("auto", "dense")
    for label in order:
        start = time.perf_counter()
        out = engine.generate(
            **case.options(args.paper_new_tokens, sparse=None if label == "dense" else "auto")
        )
        requests[label] = {
            "text": out.text,
            "ok": exact_match(out.text, case.answer),
            "request_s": time.perf_counter() - start,
            "ttft_s": out.stats.get("ttft_s"),
            "sparse_policy": out.stats.get("sparse_policy"),
            "sparse_auto": out.stats.get("sparse_auto"),
            "tokens": len(out.token_ids),
        }
    return {
        "index": case.index,
        "length": case.length,
        "depth": case.depth,
        "answer": case.answer,
        "papers": case.papers,
        "prompt_tokens": len(base.layout),
        "runs": runs,
        "requests": requests,
    }


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (length, run): solved / cases beside dense's on the same cases; auto's request time
    against dense's (paired, interleaved)."""
    rows = []
    for length in sorted({r["length"] for r in records}):
        at = [r for r in records if r["length"] == length]
        dense_ok = sum(r["runs"]["dense"]["ok"] for r in at)
        for label in at[0]["runs"]:
            ok = sum(r["runs"][label]["ok"] for r in at)
            rows.append(
                {
                    "length": length,
                    "run": label,
                    "how": "fork",
                    "cases": len(at),
                    "solved": ok,
                    "dense_solved": dense_ok,
                    "lost_vs_dense": sum(r["runs"]["dense"]["ok"] and not r["runs"][label]["ok"] for r in at),
                    "ms_per_step": median([r["runs"][label]["ms"] for r in at]),
                    "request_time_vs_dense": None,
                    "ttft_vs_dense": None,
                }
            )
        dense_s = [r["requests"]["dense"]["request_s"] for r in at]
        auto_s = [r["requests"]["auto"]["request_s"] for r in at]
        speed = paired_speedup(dense_s, auto_s)
        first = paired_speedup(
            [r["requests"]["dense"]["ttft_s"] for r in at], [r["requests"]["auto"]["ttft_s"] for r in at]
        )
        policies = sorted({str(r["requests"]["auto"]["sparse_policy"] or "dense") for r in at})
        rows.append(
            {
                "length": length,
                "run": f"auto ({', '.join(policies)})",
                "how": "request",
                "cases": len(at),
                "solved": sum(r["requests"]["auto"]["ok"] for r in at),
                "dense_solved": sum(r["requests"]["dense"]["ok"] for r in at),
                "lost_vs_dense": sum(
                    r["requests"]["dense"]["ok"] and not r["requests"]["auto"]["ok"] for r in at
                ),
                "ms_per_step": None,
                "request_time_vs_dense": f"{speed.ratio:.3f}x [{speed.low:.3f}, {speed.high:.3f}]",
                "ttft_vs_dense": f"{first.ratio:.3f}x [{first.low:.3f}, {first.high:.3f}]",
            }
        )
    return rows


NOTES = """
solved = the verification number appears in the answer (normalised); dense_solved: dense decoding on the
same cases; lost_vs_dense = cases dense solves and the run does not. how: fork = decoded from a fork of
one prefilled case (the same first token); request = whole requests (`engine.generate`), auto against
dense, interleaved (order alternating per case). request_time_vs_dense = dense's request time / auto's
(> 1: auto faster), median of the per-case ratios with its interval; ttft_vs_dense: the same for the time
to the first token. auto's choice per case (policy or why dense) is in the cases file (`sparse_auto`).
"""


def run(args: argparse.Namespace, configs, make_decoder) -> int:
    from semkv.engine import Engine

    torch.set_num_threads(args.threads or 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"sparse_paperkeys{args.tag}"
    cases_path = out / f"{name}_cases.jsonl"
    if cases_path.exists():
        cases_path.unlink()
    config = {k: v for k, v in vars(args).items() if k not in ("bench_run", "func")}
    engine = Engine.from_args(args, threads=args.threads or 1)
    warm = make_cases(engine.tokenizer, 512, 1, seed=args.seed + 99, split=args.paper_split)[0]
    run_case(engine, warm, args, configs[:1], make_decoder)  # warm-up, excluded
    records: list[dict[str, Any]] = []
    for length in args.lengths:
        cases = make_cases(engine.tokenizer, length, args.cases, seed=args.seed, split=args.paper_split)
        for case in tqdm(cases, desc=f"paperkeys {length}", unit="case"):
            records.append(run_case(engine, case, args, configs, make_decoder))
            with cases_path.open("a") as f:
                f.write(json.dumps(records[-1]) + "\n")
            write_results(out, name, summarise(records), config, notes=NOTES)
    print((out / f"{name}.md").read_text())
    _print_auto_notes(records)
    return 0


def _print_auto_notes(records: list[dict[str, Any]]) -> None:
    notes = statistics.multimode(str(r["requests"]["auto"]["sparse_auto"]) for r in records)
    print(f"sparse_auto (most common): {notes[0] if notes else '-'}")
