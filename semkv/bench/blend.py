"""CacheBlend: RAG over cached chunks — TTFT and answer quality of every row selector vs full prefill.

Workloads (``--dataset``), both chat-templated as users send RAG prompts:

* ``hotpotqa`` (default): HotpotQA dev distractor questions from the seeded dev/test split of
  :mod:`semkv.evaluation.corpora` (``--split``), each laid out by :mod:`semkv.evaluation.hotpotqa`:
  every paragraph one chunk (``"Title: ...\\n<text>"``), padded with other questions' paragraphs to
  ``--target-tokens``, a system turn asking for a short answer, the question after the documents.
  Paragraphs recur across questions and are precomputed once (``engine.add_chunks``). Scored with
  HotpotQA's official EM / F1 on the answer :func:`~semkv.evaluation.hotpotqa.extract_answer` takes out
  of the generation (leading "Answer:" / "The answer is" cues, first line, first sentence, no
  parenthetical asides); ``em_raw`` / ``f1_raw`` score the generation's first line as it is.
* ``squad``: a second prompt format (the defaults are chosen on HotpotQA's; this checks them elsewhere):
  SQuAD v2.0 dev answerable questions from the seeded split of :mod:`semkv.evaluation.corpora`
  (``--split``), laid out by :func:`squad_workload`: the question's own paragraph and its article's
  neighbouring paragraphs, untitled, **in the article's order** (HotpotQA's are shuffled), up to
  ``--target-tokens``; no system turn (the chat template's own), and an extractive instruction after the
  documents asking for the exact words of the passage. Scored with SQuAD's EM / F1 (the best over the
  annotators' answers) of the extracted answer, and ``correct``: an annotator's answer, normalised, occurs
  in the normalised extracted answer. ``--squad-layout`` (one workload per layout, the same questions and
  paragraphs): ``article`` (the above: one chunk per paragraph), ``shuffled`` (the same chunks in a seeded
  order), ``joined`` (the article's paragraphs one chunk, joined by the chunk separator as the prompt joins
  chunks, so full prefill reads the same text; the other articles' paragraphs one chunk each).
* ``essays``: Paul Graham essay chunks of ``--chunk-tokens`` tokens, each holding one inserted fact
  (a made-up person's code word, city or pet), ``--chunks`` of them per question (one variant per
  count), one worked example turn; scored by exact match (the answer occurs) and best-window F1.

Rows, measured side by side on the same questions in one run (warm-up excluded): full prefill,
prefix caching only (the template's blocks are stored; chunk order changes between questions, so
chunks never hit as a prefix), full reuse (ratio 0 = naive concatenation of the cached chunks), and
every ``--selector`` at every ``--ratios`` (or the rows given by ``--row``). ``--ablation-questions``
adds, on the first questions, the deviation ablation (K / V / K+V, check layers, gradual filtering,
the chunks' attention sink) around the default config.

Columns: TTFT median and speed-up over full prefill (same run), EM, F1 (hotpotqa: also raw), the paired F1 difference to
full prefill with its 95% interval (and questions gained / lost), first-token KL(full || row) and
top-1 agreement, agreement with the full-prefill answer, degenerate loops (answers whose last 12
tokens repeat a 3-gram 3+ times), tokens recomputed, and for blend rows the share of the selected
chunk tokens among the first 8 of their chunk and (hotpotqa) inside the gold paragraphs.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from semkv.bench.report import line_plot, markdown_table, median, write_results
from semkv.config import StoreConfig
from semkv.engine import Engine
from semkv.evaluation import metrics
from semkv.evaluation.corpora import (
    HOTPOT_DEV_SIZE,
    SPLIT_SEED,
    SPLITS,
    SquadItem,
    load_hotpotqa,
    split_ids,
    squad_articles,
    squad_split,
)
from semkv.evaluation.documents import build_pool, build_questions, messages_for
from semkv.evaluation.hotpotqa import RagBuilder, RagConfig, extract_answer, first_line, hotpot_score
from semkv.prompt import CHUNK_SEPARATOR, build_layout
from semkv.reuse.options import SINK_MODES, BlendConfig

log = logging.getLogger(__name__)

DEFAULT_SELECTORS = ("deviation", "query", "query+deviation", "chunk-start")


@dataclass
class BenchCase:
    """One question: chunk texts in layout order, the conversation, the gold answer, and the indices of
    the chunks that hold the answer (hotpotqa: the supporting paragraphs; essays: the fact's chunk)."""

    id: str
    chunks: list[str]
    messages: list[dict[str, str]]
    answer: str
    gold: tuple[int, ...] = ()


@dataclass
class Workload:
    """A named list of cases and how an answer is scored: ``score(text, answer) -> {"em": .., "f1": ..,
    ...}`` (em / f1 the headline, other keys extra columns); ``answer(text)`` is the answer a generation
    holds, compared across rows for agreement with full prefill."""

    name: str
    cases: list[BenchCase]
    score: Callable[[str, str], dict[str, float]]
    answer: Callable[[str], str] = first_line
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RowSpec:
    label: str
    reuse: str
    config: BlendConfig | None = None
    sink: str = BlendConfig.sink  # the sink the chunks of this row are precomputed with


# -- workloads ------------------------------------------------------------------------------------------


def score_hotpot(text: str, answer: str) -> dict[str, float]:
    """HotpotQA EM / F1 of the extracted answer, and (``*_raw``) of the generation's first line as is."""
    extracted, raw = hotpot_score(extract_answer(text), answer), hotpot_score(first_line(text), answer)
    return {"em": extracted.em, "f1": extracted.f1, "em_raw": raw.em, "f1_raw": raw.f1}


def score_essay(text: str, answer: str) -> dict[str, float]:
    return {"em": float(metrics.exact_match(text, answer)), "f1": metrics.best_answer_f1(text, answer)}


def hotpot_workload(
    tokenizer, split: str, questions: int, skip: int, target_tokens: int, seed: int
) -> Workload:
    """``questions`` cases from position ``skip`` of the seeded HotpotQA ``split``."""
    items = {item.id: item for item in load_hotpotqa()}
    ids = split_ids(items, split, HOTPOT_DEV_SIZE)[skip : skip + questions]
    builder = RagBuilder(RagConfig(target_tokens=target_tokens, seed=seed), tokenizer)
    cases = []
    for item_id in tqdm(ids, desc=f"hotpotqa {split} cases", unit="q", disable=len(ids) < 50):
        case = builder.build(items[item_id])
        cases.append(BenchCase(case.id, list(case.chunks), case.messages(), case.answer, case.gold))
    config = {
        "split": split,
        "split_seed": SPLIT_SEED,
        "skip": skip,
        "target_tokens": target_tokens,
        "seed": seed,
    }
    return Workload("hotpotqa", cases, score_hotpot, extract_answer, config)


SQUAD_ANSWERS_SEPARATOR = "\n"  # BenchCase.answer of a squad case: the annotators' answers, one a line
SQUAD_INSTRUCTION = (
    "Using only the passages above, answer the question below with the exact words of the passage that "
    "answers it: a short phrase copied from the text.\nQuestion: {question}"
)


def score_squad(text: str, answers: str) -> dict[str, float]:
    """SQuAD EM / F1 of the extracted answer against the best of the annotators' ``answers`` (one a line),
    and ``correct``: one of them, normalised, occurs in the normalised extracted answer (a longer reply
    that holds the span counts)."""
    extracted = extract_answer(text)
    golds = [a for a in answers.split(SQUAD_ANSWERS_SEPARATOR) if a.strip()]
    scores = [hotpot_score(extracted, gold) for gold in golds]
    pred = f" {metrics.normalize_answer(extracted)} "
    correct = any(f" {metrics.normalize_answer(gold)} " in pred for gold in golds)
    return {"em": max(s.em for s in scores), "f1": max(s.f1 for s in scores), "correct": float(correct)}


def squad_messages(question: str) -> list[dict[str, str]]:
    """No system turn (the chat template's own); the extractive instruction and the question after the
    documents."""
    return [{"role": "user", "content": SQUAD_INSTRUCTION.format(question=question)}]


SQUAD_LAYOUTS = ("article", "shuffled", "joined")


def check_squad_layout(layout: str) -> None:
    """ValueError unless ``layout`` is one of :data:`SQUAD_LAYOUTS`."""
    if layout not in SQUAD_LAYOUTS:
        raise ValueError(f"unknown squad layout {layout!r}: one of {', '.join(SQUAD_LAYOUTS)}")


@dataclass(frozen=True)
class SquadChunks:
    """A SQuAD case's chunks in layout order: ``gold`` the index of the chunk holding the question's
    paragraph, ``own`` how many leading chunks (``article`` layout) are its article's paragraphs."""

    chunks: list[str]
    gold: int
    own: int

    def laid_out(self, layout: str, seed: str) -> SquadChunks:
        """These chunks in ``layout`` (see the module docstring); ``seed`` seeds the ``shuffled`` order."""
        check_squad_layout(layout)
        if layout == "article":
            return self
        if layout == "shuffled":
            order = list(range(len(self.chunks)))
            random.Random(seed).shuffle(order)
            return SquadChunks([self.chunks[i] for i in order], order.index(self.gold), 0)
        joined = CHUNK_SEPARATOR.join(self.chunks[: self.own])  # "joined"
        return SquadChunks([joined, *self.chunks[self.own :]], 0, 1)


def squad_chunks(item: SquadItem, budget: int, cost: Callable[[str], int]) -> SquadChunks:
    """The item's paragraph and its article's paragraphs nearest to it (one before, one after, in turn)
    while their ``cost`` fits ``budget``, in the article's order; then other articles' paragraphs (in the
    corpus order) after them while they fit (the ``article`` layout)."""
    article = list(squad_articles()[item.article])
    at = article.index(item.context)
    lo, hi, used = at, at + 1, cost(item.context)
    grew = True
    while grew:
        grew = False
        for side in ("before", "after"):
            if side == "before" and lo > 0 and used + cost(article[lo - 1]) <= budget:
                lo, used, grew = lo - 1, used + cost(article[lo - 1]), True
            elif side == "after" and hi < len(article) and used + cost(article[hi]) <= budget:
                hi, used, grew = hi + 1, used + cost(article[hi]), True
    chunks = article[lo:hi]
    own = len(chunks)
    for title, paragraphs in squad_articles().items():
        if title == item.article:
            continue
        for paragraph in paragraphs:
            if used + cost(paragraph) <= budget:
                chunks.append(paragraph)
                used += cost(paragraph)
        if used >= budget * 0.98:
            break
    return SquadChunks(chunks, at - lo, own)


def squad_layouts(text: str) -> list[str]:
    """``--squad-layout``'s comma-separated layouts, checked (a bad name fails before a model loads)."""
    layouts = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in layouts if x not in SQUAD_LAYOUTS]
    if not layouts or bad:
        raise ValueError(f"--squad-layout takes {', '.join(SQUAD_LAYOUTS)} (comma-separated), got {text!r}")
    return layouts


def squad_workload(
    tokenizer,
    split: str,
    questions: int,
    skip: int,
    target_tokens: int,
    layout: str = "article",
    seed: int = 0,
) -> Workload:
    """``questions`` SQuAD cases from position ``skip`` of the seeded ``split`` (see the module docstring),
    each padded to about ``target_tokens`` as the tokenizer lays it out, its chunks in ``layout``."""
    check_squad_layout(layout)
    items = squad_split(split)[skip : skip + questions]  # type: ignore[arg-type]
    separator = len(tokenizer(CHUNK_SEPARATOR, add_special_tokens=False)["input_ids"])
    counts: dict[str, int] = {}

    def cost(text: str) -> int:
        if text not in counts:
            counts[text] = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + separator
        return counts[text]

    cases = []
    for item in items:
        messages = squad_messages(item.question)
        budget = target_tokens - len(build_layout(tokenizer, messages=messages))
        laid = squad_chunks(item, budget, cost).laid_out(layout, f"{seed}:{item.id}")
        answer = SQUAD_ANSWERS_SEPARATOR.join(item.answers)
        cases.append(BenchCase(item.id, laid.chunks, messages, answer, (laid.gold,)))
    config = {
        "split": split,
        "split_seed": SPLIT_SEED,
        "skip": skip,
        "target_tokens": target_tokens,
        "layout": layout,
        "seed": seed,
    }
    name = "squad" if layout == "article" else f"squad {layout}"
    return Workload(name, cases, score_squad, extract_answer, config)


def essay_workloads(tokenizer, args: argparse.Namespace) -> list[Workload]:
    """One workload per ``--chunks`` count over one pool of fact-bearing essay chunks."""
    variants = [int(x) for x in str(args.chunks).split(",") if x.strip()]
    if not variants or min(variants) < 1:
        raise ValueError("--chunks needs at least one count >= 1")
    pool = build_pool(tokenizer, max(args.pool, max(variants)), args.chunk_tokens, args.seed)
    out = []
    for count in variants:
        questions = build_questions(pool, args.skip + args.questions, count, args.seed + count)[args.skip :]
        cases = [
            BenchCase(
                f"essay-{count}-{i}",
                [pool[c].text for c in q.chunks],
                messages_for(q.question),
                q.answer,
                (q.chunks.index(q.target),),
            )
            for i, q in enumerate(questions)
        ]
        out.append(
            Workload(f"{count} chunks", cases, score_essay, config={"chunks": count, "seed": args.seed})
        )
    return out


# -- rows -------------------------------------------------------------------------------------------------


def parse_selector(spec: str) -> str | dict[str, Any]:
    """``name`` or ``name:key=value,key=value`` (values as JSON, else strings) -> a selector spec."""
    name, _, options = spec.partition(":")
    if not options:
        return name
    out: dict[str, Any] = {"name": name}
    for part in _split_options(options):
        key, sep, raw = part.partition("=")
        if not sep:
            raise ValueError(f"selector option {part!r} in {spec!r} is not key=value")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def _split_options(text: str) -> list[str]:
    """Split on commas outside brackets (``layers=[1,2],k=3``)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current] if current else parts


def blend_row(spec: str, ratio: float, base: BlendConfig) -> RowSpec:
    """A blend row: the selector's own check layer, ``base``'s gradual filtering, chunk sink and separators."""
    config = BlendConfig(
        ratio,
        parse_selector(spec),
        gradual=base.gradual,
        sink=base.sink,
        separator_in_chunk=base.separator_in_chunk,
    )
    return RowSpec(f"{spec} {ratio:.2f}", "blend", config)


def main_rows(args: argparse.Namespace, base: BlendConfig) -> list[RowSpec]:
    rows = [RowSpec("full prefill", "none")]
    if not args.no_prefix_row:
        rows.append(RowSpec("prefix caching only", "prefix"))
    if not args.no_zero_row:
        zero = BlendConfig(0.0, sink=base.sink, separator_in_chunk=base.separator_in_chunk)
        rows.append(RowSpec("full reuse (ratio 0)", "blend", zero))
    if args.row:
        pairs = []
        for entry in args.row:
            spec, sep, ratio = entry.rpartition("@")
            if not sep:
                raise ValueError(f"--row {entry!r} must be SELECTOR@RATIO")
            pairs.append((spec, float(ratio)))
    else:
        ratios = [float(x) for x in str(args.ratios).split(",") if x.strip()]
        pairs = [(spec, ratio) for spec in args.selector or list(DEFAULT_SELECTORS) for ratio in ratios]
    for spec, ratio in pairs:
        rows.append(blend_row(spec, ratio, base))
        if args.separators == "both":  # the same row with the separators recomputed
            row = blend_row(spec, ratio, replace(base, separator_in_chunk=False))
            rows.append(replace(row, label=f"{row.label} separators recomputed"))
    return rows


def ablation_rows(default: BlendConfig, ratio: float, num_layers: int) -> list[RowSpec]:
    """CacheBlend's deviation ablation: K / V / K+V, check layers, gradual filtering, and the chunks'
    attention sink (full reuse and deviation under each sink other than ``default``'s)."""

    def deviation(label: str, **options: Any) -> RowSpec:
        selector = {"name": "deviation", "on": options.pop("on", "k")}
        options.setdefault("separator_in_chunk", default.separator_in_chunk)
        return RowSpec(
            label, "blend", BlendConfig(ratio, selector, **options), options.get("sink", default.sink)
        )

    rows = [RowSpec("full prefill", "none"), deviation(f"deviation {ratio:.2f}")]
    rows += [deviation(f"deviation:on={on} {ratio:.2f}", on=on) for on in ("v", "kv")]
    for layer in (2, 4, num_layers // 4):
        if 1 < layer < num_layers:
            rows.append(deviation(f"deviation {ratio:.2f} check={layer}", check_layer=layer))
    rows.append(deviation(f"deviation {ratio:.2f} gradual", gradual=True))
    for sink in SINK_MODES:
        if sink != default.sink:
            zero = BlendConfig(0.0, sink=sink, separator_in_chunk=default.separator_in_chunk)
            rows.append(RowSpec(f"full reuse sink={sink}", "blend", zero, sink))
            rows.append(deviation(f"deviation {ratio:.2f} sink={sink}", sink=sink))
    return rows


# -- running -------------------------------------------------------------------------------------------


def _selection_shares(tokenizer, case: BenchCase, rows: list[int]) -> tuple[float | None, float | None]:
    """Of the selected chunk tokens: the share among the first 8 of their chunk, and inside gold chunks."""
    layout = build_layout(tokenizer, messages=case.messages, chunks=case.chunks)
    chosen = set(rows)
    inside = first = gold = 0
    for index, (_, start, end) in enumerate(layout.chunk_spans()):
        picked = [r for r in range(start, end) if r in chosen]
        inside += len(picked)
        first += sum(r < start + 8 for r in picked)
        gold += len(picked) if index in case.gold else 0
    if not inside:
        return None, None
    return first / inside, (gold / inside if case.gold else None)


def run_row(
    engine: Engine, spec: RowSpec, case: BenchCase, max_new: int, repair_loops: bool = True
) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        chunks=case.chunks,
        reuse=spec.reuse,
        max_new_tokens=max_new,
        store_prompt=False,
        repair_loops=repair_loops,
    )
    if spec.config is not None:
        options["blend"] = spec.config
    g = engine.generate(messages=case.messages, **options)
    if spec.reuse == "blend" and g.stats["path"] != "blend":
        raise RuntimeError(f"{spec.label}: expected the blend path, got {g.stats['path']}")
    return {"text": g.text, "token_ids": list(g.token_ids), "logits": g.first_logits, "stats": g.stats}


def run_cases(
    engine: Engine,
    workload: Workload,
    cases: list[BenchCase],
    specs: list[RowSpec],
    max_new: int,
    on_case: Callable[[dict[str, list[dict]]], None] | None = None,
    repair_loops: bool = True,
) -> dict[str, list[dict]]:
    """Per row label, one record per case (rows interleaved per case). ``specs[0]`` must be full
    prefill: its first-token logits are every row's KL reference. ``repair_loops``: the requests'
    :mod:`semkv.loop_repair` switch (a repair's time is in the answer's decode time, not in TTFT)."""
    if specs[0].label != "full prefill":
        raise ValueError("the first row must be full prefill (the reference)")
    results: dict[str, list[dict]] = {s.label: [] for s in specs}
    for group in _group_by_sink(specs):
        chunk_configs = _chunk_configs(group)
        for config in chunk_configs:
            engine.add_chunks(cases[0].chunks, config)
        for spec in group:  # warm-up, excluded
            run_row(engine, spec, cases[0], 1)
        for i, case in enumerate(tqdm(cases, desc=f"{workload.name} sink={group[0].sink}", unit="q")):
            for config in chunk_configs:
                engine.add_chunks(case.chunks, config)
            for spec in group:
                out = run_row(engine, spec, case, max_new, repair_loops)
                full = out["logits"] if spec is specs[0] else results[specs[0].label][i]["logits"]
                results[spec.label].append(_record(engine, workload, case, spec, out, full))
            if on_case is not None:
                on_case(results)
    return results


def _record(
    engine: Engine, workload: Workload, case: BenchCase, spec: RowSpec, out: dict[str, Any], full_logits
) -> dict[str, Any]:
    """What is kept of one row on one case (logits only for full prefill, the KL reference)."""
    stats = out["stats"]
    record: dict[str, Any] = {
        "id": case.id,
        "text": out["text"],
        "extracted": workload.answer(out["text"]),
        **workload.score(out["text"], case.answer),
        "ttft_s": stats["ttft_s"],
        "prompt_tokens": stats["prompt_tokens"],
        "recomputed": stats["recomputed_tokens"],
        "loop": metrics.degenerate_loop(out["token_ids"]),
        "repaired": "loop_repair" in stats,
        "kl": metrics.logit_kl(full_logits, out["logits"]),
        "top1": metrics.top1_agree(full_logits, out["logits"]),
    }
    if spec.label == "full prefill":
        record["logits"] = out["logits"]
    if spec.reuse == "blend":
        record["first8"], record["gold_share"] = _selection_shares(
            engine.tokenizer, case, stats["recomputed_rows"]
        )
    return record


def _chunk_configs(group: list[RowSpec]) -> list[BlendConfig]:
    """How the chunks of a group of rows (one sink) are precomputed: with their separators, without, or
    both, as the group's blend rows ask (the default's way when no row does)."""
    stored = {spec.config.separator_in_chunk for spec in group if spec.config is not None}
    flags = sorted(stored) or [BlendConfig.separator_in_chunk]
    return [BlendConfig(sink=group[0].sink, separator_in_chunk=flag) for flag in flags]


def _group_by_sink(specs: list[RowSpec]) -> list[list[RowSpec]]:
    """Rows by the sink their chunks need, in order of first appearance."""
    groups: dict[str, list[RowSpec]] = {}
    for s in specs:
        groups.setdefault(s.sink, []).append(s)
    return list(groups.values())


# -- summaries -------------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarise(variant: str, label: str, records: list[dict], full: list[dict]) -> dict[str, Any]:
    full_ttft = median([r["ttft_s"] for r in full])
    ttft = median([r["ttft_s"] for r in records])
    row: dict[str, Any] = {
        "variant": variant,
        "row": label,
        "n": len(records),
        "prompt_tokens": _mean([r["prompt_tokens"] for r in records]),
        "ttft_s": ttft,
        "speedup": full_ttft / ttft,
        "em": _mean([r["em"] for r in records]),
        "f1": _mean([r["f1"] for r in records]),
        "em_raw": _mean([r["em_raw"] for r in records]) if "em_raw" in records[0] else "",
        "f1_raw": _mean([r["f1_raw"] for r in records]) if "f1_raw" in records[0] else "",
        "kl": _mean([r["kl"] for r in records]),
        "top1": _mean([float(r["top1"]) for r in records]),
        "agree_full": _mean(
            [
                float(metrics.normalize_answer(r["extracted"]) == metrics.normalize_answer(f["extracted"]))
                for r, f in zip(records, full, strict=True)
            ]
        ),
        "correct": sum(r["correct"] for r in records) if "correct" in records[0] else "",
        "loops": sum(r["loop"] for r in records),
        "repaired": sum(r.get("repaired", False) for r in records),  # shards from before the repair: none
        "recomputed": _mean([r["recomputed"] for r in records]),
    }
    paired = metrics.paired_speedup([f["ttft_s"] for f in full], [r["ttft_s"] for r in records])
    row.update(speedup_paired=paired.ratio, speedup_low=paired.low, speedup_high=paired.high)
    diff = metrics.paired_difference([r["f1"] for r in records], [f["f1"] for f in full])
    row.update(f1_diff=diff.mean, f1_low=diff.low, f1_high=diff.high, gained=diff.gained, lost=diff.lost)
    for key in ("first8", "gold_share"):
        values = [r[key] for r in records if r.get(key) is not None]
        row[key] = _mean(values) if values else ""
    return row


COLUMNS = [
    "variant",
    "row",
    "n",
    "prompt_tokens",
    "ttft_s",
    "speedup",
    "speedup_paired",
    "speedup_low",
    "speedup_high",
    "em",
    "f1",
    "em_raw",
    "f1_raw",
    "f1_diff",
    "f1_low",
    "f1_high",
    "gained",
    "lost",
    "kl",
    "top1",
    "agree_full",
    "correct",
    "loops",
    "repaired",
    "recomputed",
    "first8",
    "gold_share",
]


def summarise_all(variant: str, labels: Sequence[str], results: dict[str, list[dict]]) -> list[dict]:
    """One summary row per label (in order) over the cases every row has finished."""
    done = min(len(results[label]) for label in labels)
    if done == 0:
        return []
    full = results["full prefill"][:done]
    return [summarise(variant, label, results[label][:done], full) for label in labels]


def _per_question(results: dict[str, list[dict]]) -> dict[str, list[dict]]:
    return {
        label: [{k: v for k, v in r.items() if k != "logits"} for r in records]
        for label, records in results.items()
    }


# -- merging runs split over processes ------------------------------------------------------------------


@dataclass
class MergedRuns:
    """Per-question records of several ``blend.json`` files, concatenated per workload and row.

    ``labels``: per workload, its rows in order (``"full prefill"`` first); ``timings_valid``: False when
    any source ran without the exclusive lock (its TTFTs, and so the speed-ups, are not measurements)."""

    results: dict[str, dict[str, list[dict]]]
    labels: dict[str, list[str]]
    sources: list[dict[str, Any]]
    timings_valid: bool


def merge_runs(paths: Sequence[Path]) -> MergedRuns:
    """Concatenate the per-question records of ``blend.json`` files (e.g. ``--skip`` shards of one split).

    Every file must have the same workloads, each with the same rows in the same order, and the same
    workload settings apart from ``skip``; a question id may occur once per workload. ValueError otherwise.
    """
    if not paths:
        raise ValueError("--merge needs at least one blend.json")
    results: dict[str, dict[str, list[dict]]] = {}
    labels: dict[str, list[str]] = {}
    settings: list[dict[str, Any]] | None = None
    sources, timings_valid = [], True
    for path in paths:
        payload = json.loads(Path(path).read_text())
        if payload.get("suite") != "blend" or "per_question" not in payload:
            raise ValueError(f"--merge: {path} is not a blend.json with per-question records")
        config = payload["config"]
        shard = [{k: v for k, v in w.items() if k != "skip"} for w in config.get("workloads", [])]
        if settings is None:
            settings = shard
        elif shard != settings:
            raise ValueError(
                f"--merge: {path} has other workload settings ({shard}) than {paths[0]} ({settings})"
            )
        timings_valid &= config.get("lock", "exclusive") == "exclusive" and not config.get("no_lock", False)
        sources.append({"path": str(path), "skip": config.get("skip"), "model": config.get("model")})
        for workload, rows in payload["per_question"].items():
            _merge_workload(path, workload, rows, results, labels)
    return MergedRuns(results, labels, sources, timings_valid)


def _merge_workload(
    path: Path,
    workload: str,
    rows: dict[str, list[dict]],
    results: dict[str, dict[str, list[dict]]],
    labels: dict[str, list[str]],
) -> None:
    """Append one file's records of ``workload`` (rows cut to the questions every row finished)."""
    order = list(rows)
    if labels.setdefault(workload, order) != order:
        raise ValueError(f"--merge: {path} has rows {order} for {workload!r}, expected {labels[workload]}")
    if not order or order[0] != "full prefill":
        raise ValueError(f"--merge: {path}: the first row of {workload!r} must be full prefill")
    done = min(len(records) for records in rows.values())
    merged = results.setdefault(workload, {label: [] for label in order})
    seen = {r["id"] for r in merged["full prefill"]}
    for record in rows["full prefill"][:done]:
        if record["id"] in seen:
            raise ValueError(f"--merge: question {record['id']} of {workload!r} occurs twice ({path})")
    for label in order:
        merged[label] += rows[label][:done]


def run_merge(args: argparse.Namespace) -> int:
    """``--merge``: the tables and plot of several runs' per-question records, as one run."""
    merged = merge_runs([Path(p) for p in args.merge])
    rows = [
        row
        for workload, labels in merged.labels.items()
        for row in summarise_all(workload, labels, merged.results[workload])
    ]
    config = {"merge": merged.sources, "timings_valid": merged.timings_valid}
    notes = _notes_for(next(iter(merged.labels)) if merged.labels else "")
    if not merged.timings_valid:
        notes = (
            "**ttft_s and the speedup columns are not measurements**: a merged run held the lock shared "
            "(quality only).\n\n" + notes
        )
    out = Path(args.out)
    write_results(out, "blend", rows, config, COLUMNS, extra={"per_question": merged.results}, notes=notes)
    _plot(out, rows, list(merged.labels))
    print(markdown_table(rows, COLUMNS))  # noqa: T201  (the command's output)
    print(f"merged {len(args.merge)} runs into {out}/blend.json, blend.md and blend.png")  # noqa: T201
    return 0


# -- the command -----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=("hotpotqa", "squad", "essays"), default="hotpotqa")
    parser.add_argument("--questions", type=int, default=50, help="questions per workload")
    parser.add_argument(
        "--skip", type=int, default=0, help="start at this position of the split / question list"
    )
    parser.add_argument("--split", choices=SPLITS, default="dev", help="hotpotqa / squad: the seeded split")
    parser.add_argument(
        "--target-tokens", type=int, default=4096, help="hotpotqa / squad: pad each prompt to this"
    )
    parser.add_argument(
        "--squad-layout",
        default="article",
        help=f"squad: chunk layouts, comma-separated, one workload each ({', '.join(SQUAD_LAYOUTS)})",
    )
    parser.add_argument("--chunks", default="8,4", help="essays: chunks per question, one workload each")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="essays: tokens per chunk")
    parser.add_argument(
        "--pool", type=int, default=24, help="essays: distinct chunks (each holding one fact)"
    )
    parser.add_argument("--ratios", default="0.05,0.10,0.15,0.30")
    parser.add_argument(
        "--selector",
        action="append",
        default=None,
        help=f"a row selector, NAME or NAME:key=value,... (repeatable; default {', '.join(DEFAULT_SELECTORS)})",
    )
    parser.add_argument(
        "--row", action="append", default=None, help="SELECTOR@RATIO rows instead of the product"
    )
    parser.add_argument("--no-prefix-row", action="store_true", help="skip the prefix-caching-only row")
    parser.add_argument(
        "--separators",
        choices=("stored", "recomputed", "both"),
        default=None,
        help="chunk separators stored with their chunk or recomputed (default: the engine's blend default); "
        "both: every blend row twice, the second with them recomputed",
    )
    parser.add_argument(
        "--no-repair-loops",
        action="store_true",
        help="decode blend answers without loop repair (semkv/loop_repair.py), as before it existed",
    )
    parser.add_argument("--no-zero-row", action="store_true", help="skip the full-reuse (ratio 0) row")
    parser.add_argument("--ablation-questions", type=int, default=0, help="deviation ablation on the first N")
    parser.add_argument("--ablation-ratio", type=float, default=0.15)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="the cases' seed (hotpotqa: padding and order)")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="BLEND_JSON",
        help="only summarise these runs' blend.json files as one run (e.g. --skip shards); no model is loaded",
    )


def _notes(workloads: list[Workload]) -> str:
    return _notes_for(workloads[0].name)


def _notes_for(first_workload: str) -> str:
    return (
        "speedup = full-prefill TTFT median / row TTFT median (same run); speedup_paired = geometric mean "
        "of the per-question speed-ups (full prefill and the row on the same question, seconds apart) with "
        "its 95% interval [speedup_low, speedup_high]. em / f1: "
        + (
            "HotpotQA's official scoring of the extracted answer (leading answer cues, first line, first "
            "sentence, no parenthetical asides); em_raw / f1_raw: of the generation's first line as is; "
            if first_workload == "hotpotqa"
            else "SQuAD's scoring of the extracted answer, the best over the annotators' answers; correct = "
            "answers holding an annotator's answer (normalised); "
            if first_workload == "squad"
            else ""
        )
        + "f1_diff = mean paired F1 difference to full prefill with its 95% interval [f1_low, f1_high], "
        "gained / lost = questions scored higher / lower; kl = KL(full || row) of the first generated token; "
        "agree_full = same normalised answer as full prefill; loops = answers whose last 12 tokens repeat "
        "a 3-gram 3+ times (after loop repair); repaired = answers loop repair recomputed and rolled back "
        "(semkv/loop_repair.py; off with --no-repair-loops); first8 / gold_share = share of the selected "
        "chunk tokens among the first 8 of their chunk / inside the gold chunks.\n"
    )


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return run_merge(args)
    torch.set_num_threads(args.threads or 1)
    if args.questions < 1:
        raise ValueError("--questions must be >= 1")
    layouts = squad_layouts(args.squad_layout)  # a bad layout fails before the model loads
    # memory-only store: the bench measures compute, and full prompts' KV would fill the disk
    engine = Engine.from_args(args, threads=args.threads or 1, store=StoreConfig(disk=False))
    if args.dataset == "hotpotqa":
        workloads = [
            hotpot_workload(
                engine.tokenizer, args.split, args.questions, args.skip, args.target_tokens, args.seed
            )
        ]
    elif args.dataset == "squad":
        workloads = [
            squad_workload(
                engine.tokenizer, args.split, args.questions, args.skip, args.target_tokens, layout, args.seed
            )
            for layout in layouts
        ]
    else:
        workloads = essay_workloads(engine.tokenizer, args)
    base = engine.defaults.blend
    if args.separators in ("stored", "both"):
        base = replace(base, separator_in_chunk=True)
    elif args.separators == "recomputed":
        base = replace(base, separator_in_chunk=False)
    specs = main_rows(args, base)
    labels = [s.label for s in specs]
    # the template is stored once as prefix blocks: prefix caching and blend load it
    engine.generate(messages=workloads[0].cases[0].messages, max_new_tokens=1)
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")}
    config["default_blend"] = {**vars(base), "selector": base.selector.describe()}
    config["workloads"] = [w.config for w in workloads]
    rows: list[dict[str, Any]] = []
    per_question: dict[str, Any] = {}

    def write(current: list[dict]) -> None:
        write_results(
            out,
            "blend",
            current,
            config,
            COLUMNS,
            extra={"per_question": per_question},
            notes=_notes(workloads),
        )

    for index, workload in enumerate(workloads):

        def progress(
            results: dict[str, list[dict]], workload: Workload = workload, done: list = rows
        ) -> None:
            per_question[workload.name] = _per_question(results)
            write(done + summarise_all(workload.name, labels, results))

        results = run_cases(
            engine, workload, workload.cases, specs, args.max_new_tokens, progress, not args.no_repair_loops
        )
        per_question[workload.name] = _per_question(results)
        rows += summarise_all(workload.name, labels, results)
        if index == 0 and args.ablation_questions > 0:
            sub = workload.cases[: args.ablation_questions]
            ab_specs = ablation_rows(base, args.ablation_ratio, engine.num_layers)
            ab = run_cases(engine, workload, sub, ab_specs, args.max_new_tokens)
            per_question[f"ablation {workload.name}"] = _per_question(ab)
            rows += summarise_all(f"ablation {workload.name}", [s.label for s in ab_specs], ab)
        write(rows)
    _plot(out, rows, [w.name for w in workloads])
    engine.close()
    print(markdown_table(rows, COLUMNS))  # noqa: T201  (the command's output)
    print(f"results in {out}/blend.json, blend.md and blend.png")  # noqa: T201
    return 0


def _plot(out: Path, rows: list[dict], variants: list[str]) -> None:
    """F1 over TTFT: one line per selector over its ratios, one point for full prefill, per workload."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for variant in variants:
        main = [r for r in rows if r["variant"] == variant]
        for r in main:
            name, _, ratio = r["row"].rpartition(" ")
            if r["row"] == "full prefill" or not name or not ratio.replace(".", "").isdigit():
                continue
            xs, ys = series.setdefault(f"{variant}: {name}", ([], []))
            xs.append(r["ttft_s"])
            ys.append(r["f1"])
        full = [r for r in main if r["row"] == "full prefill"]
        if full:
            series[f"{variant}: full prefill"] = ([full[0]["ttft_s"]], [full[0]["f1"]])
    if series:
        line_plot(
            out / "blend.png", series, "TTFT median (s)", "answer F1", "Blend: quality vs TTFT per selector"
        )
