"""Sparse decode on RULER (``semkv bench sparse --suite ruler``): per-task scores of every policy and budget.

Cases come from :mod:`semkv.evaluation.ruler` (our generators for RULER's 13 tasks, RULER's scoring),
rendered as a user sends them: through the chat template with RULER's answer prefix opening the reply
(instruct models), or as RULER's plain-text template (base models). Every case is prefilled ONCE; dense
decoding and every policy x budget decode greedily from forks of that prefilled sequence (the same first
token, the same cache). A decode stops at EOS, at the generation cap, or as soon as its RULER score is
100: the score only counts gold strings found in the text, so more tokens could not change it.

Per (length, policy, budget): the RULER average (mean of the task means), dense's on the same cases,
the paired difference with its 95% interval, every task's score, agreement with dense's text, decode
steps, selection share. Per-case results are appended to ``<out>/<name>_cases.jsonl`` as they finish, so
an interrupted run resumes (``--resume``) and runs split over processes merge (``--merge``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from semkv.bench.report import median, write_results
from semkv.evaluation import ruler
from semkv.evaluation.metrics import paired_difference
from semkv.request import GenerateRequest
from semkv.sparse import SparseDecoder

log = logging.getLogger(__name__)


def ruler_request(case: ruler.RulerCase, tokenizer, max_new_tokens: int) -> GenerateRequest:
    """The case as its rendering sends it: chat messages + answer prefix, or RULER's plain text."""
    chat = (
        bool(getattr(tokenizer, "chat_template", None))
        if case.rendering.chat is None
        else case.rendering.chat
    )
    common = dict(
        max_new_tokens=max_new_tokens, stop_at_eos=True, store_prompt=False, reuse="none", sparse=None
    )
    if chat:
        return GenerateRequest(
            messages=case.messages(),
            assistant_prefix=case.assistant_start(),
            use_chat_template=True,
            **common,
        )
    return GenerateRequest(prompt=case.plain_text(), use_chat_template=False, **common)


def generation_cap(case: ruler.RulerCase, cap: int | None) -> int:
    """RULER's tokens_to_generate for the task, at most ``cap``."""
    return case.tokens_to_generate if cap is None else min(case.tokens_to_generate, cap)


def decode_scored(
    engine, base, decoder: SparseDecoder | None, done: Callable[[str], bool]
) -> tuple[list[int], str, list[float]]:
    """Greedy decode from a fork of ``base`` until it finishes (EOS or its cap) or ``done(text)``.
    Returns (tokens, text, per-step seconds)."""
    seq = engine.fork(base, sparse=decoder)
    step_s: list[float] = []
    text = engine.tokenizer.decode(seq.output_ids(), skip_special_tokens=True)
    while not seq.finished and not done(text):
        start = time.perf_counter()
        engine.decode_step(seq)
        step_s.append(time.perf_counter() - start)
        text = engine.tokenizer.decode(seq.output_ids(), skip_special_tokens=True)
    if decoder is not None:
        decoder.finish()
    return seq.output_ids(), text, step_s


def run_case(
    engine, case: ruler.RulerCase, args: argparse.Namespace, configs, make_decoder
) -> dict[str, Any]:
    """Prefill once; dense and every (label, budget) config decode from forks. One JSON-able record."""
    tokenizer = engine.tokenizer
    cap = generation_cap(case, args.gen_cap)
    request = ruler_request(case, tokenizer, cap)
    base = engine.prefill(request, capture_queries=True)
    if base.layout.token_ids != ruler.prompt_ids(tokenizer, case):
        raise RuntimeError(f"{case.task} case {case.index}: the engine's prompt differs from RULER's ids")

    def done(text: str) -> bool:
        return ruler.score(case, text) >= 100.0

    runs: dict[str, Any] = {}
    tokens, text, step_s = decode_scored(engine, base, None, done)
    runs["dense"] = {"text": text, "score": ruler.score(case, text), "steps": len(step_s), "tokens": tokens}
    runs["dense"]["ms"] = 1000 * median(step_s) if step_s else None
    for label, budget, options in configs:
        decoder = make_decoder(engine, label, budget, options)
        tokens, text, step_s = decode_scored(engine, base, decoder, done)
        stats = decoder.stats(sum(step_s))
        runs[f"{label}@{budget}"] = {
            "text": text,
            "score": ruler.score(case, text),
            "steps": len(step_s),
            "tokens": tokens,
            "ms": 1000 * median(step_s) if step_s else None,
            "select_share": stats.get("select_share"),
            "prepare_s": stats.get("prepare_s"),
        }
    return {
        "length": case.length,
        "task": case.task,
        "index": case.index,
        "prompt_tokens": len(base.layout),
        "prefill_s": base.ttft_s,
        "outputs": list(case.outputs),
        "cap": cap,
        "runs": runs,
    }


def case_key(record: dict[str, Any]) -> tuple[int, str, int]:
    return (int(record["length"]), str(record["task"]), int(record["index"]))


def load_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Per-case records of one or more ``*_cases.jsonl`` files. Records of one case join their runs (runs
    split by policy over processes merge; the case's prefill is the same); of a run in several records,
    the last wins."""
    found: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    key = case_key(record)
                    runs = {**found[key]["runs"], **record["runs"]} if key in found else record["runs"]
                    found[key] = {**record, "runs": runs}
    return list(found.values())


def summarise(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(summary rows per length x run, per-task rows per length x run). Runs missing from a case are
    left out of that case's comparisons."""
    rows, task_rows = [], []
    for length in sorted({r["length"] for r in records}):
        at = [r for r in records if r["length"] == length]
        labels = sorted({label for r in at for label in r["runs"]}, key=_label_order)
        tasks = sorted({r["task"] for r in at}, key=ruler.TASK_NAMES.index)
        for label in labels:
            have = [r for r in at if label in r["runs"]]
            mine = [r["runs"][label]["score"] for r in have]
            dense = [r["runs"]["dense"]["score"] for r in have]
            per_task = {t: [r["runs"][label]["score"] for r in have if r["task"] == t] for t in tasks}
            dense_task = {t: [r["runs"]["dense"]["score"] for r in have if r["task"] == t] for t in tasks}
            means = {t: statistics.fmean(v) for t, v in per_task.items() if v}
            dense_means = {t: statistics.fmean(v) for t, v in dense_task.items() if v}
            diff = paired_difference(mine, dense)
            policy, _, budget = label.partition("@")
            shares = [r["runs"][label].get("select_share") for r in have]
            shares = [s for s in shares if s is not None]
            row = {
                "length": length,
                "policy": policy,
                "budget": float(budget) if budget else 1.0,
                "cases": len(have),
                "ruler_avg": statistics.fmean(means.values()),
                "dense_avg": statistics.fmean(dense_means.values()),
                "diff_vs_dense": diff.mean,
                "diff_95ci": f"[{diff.low:+.1f}, {diff.high:+.1f}]",
                "better_worse": f"{diff.gained}/{diff.lost}",
                "agree_dense": 100
                * statistics.fmean(r["runs"][label]["text"] == r["runs"]["dense"]["text"] for r in have),
                "steps_mean": statistics.fmean(r["runs"][label]["steps"] for r in have),
                "select_share": median(shares) if shares else None,
            }
            rows.append(row)
            task_rows.append(
                {"length": length, "run": label, **{t: round(means[t], 1) for t in tasks if t in means}}
            )
    return rows, task_rows


def _label_order(label: str) -> tuple[int, str, float]:
    policy, _, budget = label.partition("@")
    return (0 if policy == "dense" else 1 if policy == "oracle" else 2, policy, float(budget or 1))


COLUMNS = [
    "length",
    "policy",
    "budget",
    "cases",
    "ruler_avg",
    "dense_avg",
    "diff_vs_dense",
    "diff_95ci",
    "better_worse",
    "agree_dense",
    "steps_mean",
    "select_share",
]

NOTES = """
Columns: ruler_avg = mean over tasks of the task's mean RULER score (0-100; string_match_all for niah,
vt, cwe, fwe; string_match_part for qa); dense_avg = dense decoding on the same cases (same prefilled
cache); diff_vs_dense = mean per-case score difference, diff_95ci its 95% interval (Student t),
better_worse = cases scored higher / lower than dense; agree_dense = identical generated text;
steps_mean = decode steps per case (stops at EOS, the cap, or a score of 100); select_share = selection
time / decode time (median; only valid in an exclusive run). Budgets count the selected middle blocks;
the sink block and the ~32-token window come on top. The per-task table follows.
"""


def write_tables(out: Path, name: str, records: list[dict[str, Any]], config: dict[str, Any]) -> Path:
    rows, task_rows = summarise(records)
    write_results(out, name, rows, config, COLUMNS, extra={"per_task": task_rows}, notes=NOTES)
    md = out / f"{name}.md"
    lines = [md.read_text(), "\n## per task (mean RULER score)\n"]
    for length in sorted({r["length"] for r in task_rows}):
        at = [r for r in task_rows if r["length"] == length]
        tasks = [t for t in ruler.TASK_NAMES if any(t in r for r in at)]
        lines.append(f"\n### {length} tokens\n")
        lines.append("| run | " + " | ".join(tasks) + " | avg |")
        lines.append("|---" * (len(tasks) + 2) + "|")
        for r in at:
            avg = statistics.fmean(r[t] for t in tasks if t in r)
            lines.append(
                f"| {r['run']} | " + " | ".join(str(r.get(t, "-")) for t in tasks) + f" | {avg:.1f} |"
            )
    md.write_text("\n".join(lines) + "\n")
    return md


def run(args: argparse.Namespace, configs, make_decoder) -> int:
    """The RULER suite: cases per task and length, resumable, summarised into per-task tables."""
    from semkv.engine import Engine

    torch.set_num_threads(args.threads or 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"sparse_ruler{args.tag}"
    cases_path = out / f"{name}_cases.jsonl"
    config = {k: v for k, v in vars(args).items() if k not in ("bench_run", "func")}
    if args.merge:
        records = load_records([Path(p) for p in args.merge])
        print(write_tables(out, name, records, config).read_text())
        return 0
    engine = Engine.from_args(args, threads=args.threads or 1)
    done_keys = {case_key(r) for r in load_records([cases_path])} if args.resume else set()
    if not args.resume and cases_path.exists():
        cases_path.unlink()
    tasks = args.tasks or list(ruler.TASK_NAMES)
    for length in args.lengths:
        for task in tasks:
            cases = ruler.make_cases(
                engine.tokenizer, task, length, args.cases, seed=args.seed, split=args.split
            )
            for case in tqdm(cases, desc=f"ruler {task} {length}", unit="case"):
                if (length, task, case.index) in done_keys:
                    continue
                record = run_case(engine, case, args, configs, make_decoder)
                with cases_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            write_tables(out, name, load_records([cases_path]), config)
    print(write_tables(out, name, load_records([cases_path]), config).read_text())
    return 0


def e2e_timing(engine, case: ruler.RulerCase, args: argparse.Namespace, make_decoder) -> list[dict[str, Any]]:
    """Decode time as the user sees it: from the first decoded token to the last, for each answer length
    in ``args.e2e_new_tokens`` (EOS ignored), dense and each speed policy decoding from forks of one
    prefilled case, interleaved (every repetition rotates the order) so load changes hit all alike.
    Steady-state ms/step: the median step of the longest answer after its first 8 steps."""
    lengths = sorted(args.e2e_new_tokens)
    request = ruler_request(case, engine.tokenizer, max(lengths))
    request.stop_at_eos = False
    base = engine.prefill(request, capture_queries=True)
    labels = ["dense", *args.speed_policies]
    decode_s: dict[tuple[str, int], list[float]] = {}
    steady: dict[str, list[float]] = {label: [] for label in labels}
    extra: dict[str, dict[str, float]] = {label: {} for label in labels}
    bar = tqdm(total=args.e2e_reps * len(lengths) * len(labels), desc=f"e2e {len(base.layout)} tok")
    for rep in range(args.e2e_reps):
        order = labels[rep % len(labels) :] + labels[: rep % len(labels)]
        for new_tokens in lengths:
            for label in order:
                decoder = None if label == "dense" else make_decoder(engine, label, args.ablation_budget, {})
                seq = engine.fork(base, sparse=decoder)
                step_s = []
                for _ in range(new_tokens - 1):  # the first token came with the prefill
                    start = time.perf_counter()
                    engine.decode_step(seq)
                    step_s.append(time.perf_counter() - start)
                decode_s.setdefault((label, new_tokens), []).append(sum(step_s))
                if new_tokens == lengths[-1]:
                    steady[label] += step_s[8:]
                if decoder is not None:
                    stats = decoder.stats(sum(step_s))
                    for key in ("prepare_s", "select_share", "decode_summarise_s"):
                        extra[label].setdefault(key, 0.0)
                        extra[label][key] = max(extra[label][key], float(stats.get(key) or 0.0))
                bar.update()
    bar.close()
    rows = []
    # What a request sees: its first token comes from the prefill alone (block summaries are made after
    # it), and a sparse request sets its decoder up (summaries, the policy's preparation) before its first
    # decode step. The forks here were set up outside the timed steps: that set-up is added to their decode.
    ttft = base.ttft_s - base.summarise_s
    for label in labels:
        set_up = 0.0 if label == "dense" else base.summarise_s + extra[label].get("prepare_s", 0.0)
        row: dict[str, Any] = {
            "prompt_tokens": len(base.layout),
            "policy": label,
            "budget": args.ablation_budget if label != "dense" else 1.0,
            "steady_ms_per_step": 1000 * median(steady[label]),
            "steady_speedup": median(steady["dense"]) / median(steady[label]),
        }
        for new_tokens in lengths:
            mine = median(decode_s[(label, new_tokens)]) + set_up
            dense = median(decode_s[("dense", new_tokens)])
            row[f"decode_s_{new_tokens}"] = mine
            row[f"speedup_{new_tokens}"] = dense / mine
        row["ttft_s"] = ttft
        row["set_up_s"] = set_up
        row["select_share"] = extra[label].get("select_share", 0.0)
        rows.append(row)
    return rows


E2E_NOTES = """
decode_s_N: seconds from the first decoded token to the N-th (N - 1 decode steps; the first token comes
with the prefill), median over repetitions; speedup_N: dense's / the policy's. steady_ms_per_step: median
step of the longest answer after its first 8 steps. ttft_s: time to the first token (the prefill; block
summaries and a sparse decoder's set-up come after it, for dense and sparse requests alike). set_up_s: what
sparse decode adds before its first decode step (block summaries of the prompt and the policy's
preparation), counted in its decode_s_N.
select_share: selection time / decode time (largest over repetitions). Policies and dense decode from
forks of one prefilled case, interleaved.
"""


def run_e2e(args: argparse.Namespace, make_decoder) -> int:
    from semkv.engine import Engine

    torch.set_num_threads(args.threads or 1)
    engine = Engine.from_args(args, threads=args.threads or 1)
    out = Path(args.out)
    name = f"sparse_e2e{args.tag}"
    config = {k: v for k, v in vars(args).items() if k not in ("bench_run", "func")}
    rows: list[dict[str, Any]] = []
    task = (args.tasks or ["niah_single_2"])[0]
    for length in args.lengths:
        fitted = min(length + 128, engine.max_context - max(args.e2e_new_tokens))  # the answer must fit
        case = ruler.make_case(engine.tokenizer, task, fitted, seed=args.seed, split=args.split)
        rows += e2e_timing(engine, case, args, make_decoder)
        write_results(out, name, rows, config, notes=E2E_NOTES)
    print((out / f"{name}.md").read_text())
    return 0
