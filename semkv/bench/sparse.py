"""Sparse decode: needle retrieval accuracy, oracle overlap, speed and KV movement per policy and budget.

Passkey and multi-fact retrieval in Paul Graham essays at several context lengths,
needles at several depths (seeded). Every case is prefilled ONCE (the prompt's
queries captured for SnapKV/H2O); dense decoding and every policy x budget then decode
from copies of that cache, in the same process, one thread, so ms/token ratios compare
like with like. Per policy and budget: accuracy (beside dense on the same cases and on
the cases dense solves), agreement with dense tokens, overlap of the selected blocks
with the true-attention top-k (per layer, and the seed's layer-averaged form), decode
ms/token and its ratio to dense, selection share of the step, resident KV bytes and
blocks loaded per step. The seed's ablation runs Key-Key variants at one budget, and a
heat map per case shows, per decode step and block, what Key-Key selected, the oracle's
top-k and where the needle is.
"""

from __future__ import annotations

import argparse
import ast
import logging
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from semkv.bench.report import line_plot, median, write_results
from semkv.evaluation.metrics import exact_match
from semkv.evaluation.needles import TASKS, NeedleCase, answer_rows, make_cases, prompt_ids
from semkv.request import GenerateRequest
from semkv.sparse import SparseConfig, SparseDecoder, SparsePolicy, block_attention_mass, make_policy
from semkv.sparse.keykey import KeyKeyPolicy

log = logging.getLogger(__name__)

MAIN_POLICIES = ["keykey", "hybrid", "quest", "streaming", "h2o", "snapkv", "oracle"]
ABLATIONS: dict[str, dict[str, Any]] = {
    "keykey-plain": {"head_pool": "mean"},  # the seed's plain mean over heads
    "keykey-layerwise": {"layerwise": True},  # per-layer summaries
    "keykey-uncentred": {"center": False},  # the seed's cosine on raw means
    "keykey-nostab": {"stability": None},  # resident = selected (reloads without the filter)
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suite",
        choices=("needles", "ruler", "paperkeys"),
        default="needles",
        help="needles: passkey / multi-fact in essays (plain text); ruler: RULER's 13 tasks as users send them; "
        "paperkeys: a verification number in ACL papers (chat template), with sparse='auto' as whole requests",
    )
    p.add_argument(
        "--paper-split", choices=("train", "val", "test"), default="train", help="paperkeys: aclsum split"
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="context tokens")
    p.add_argument("--cases", type=int, default=30, help="cases per length (ruler: per task and length)")
    p.add_argument("--tasks", nargs="+", default=None, help="ruler: tasks (default: all 13)")
    p.add_argument("--split", choices=("dev", "test"), default="test", help="ruler: case split")
    p.add_argument(
        "--gen-cap",
        type=int,
        default=None,
        help="ruler: at most this many new tokens (default: RULER's per task)",
    )
    p.add_argument("--resume", action="store_true", help="ruler: skip cases already in the results file")
    p.add_argument("--merge", nargs="+", default=None, help="ruler: only summarise these *_cases.jsonl files")
    p.add_argument(
        "--e2e",
        action="store_true",
        help="end-to-end decode time (first decoded token to last) per answer length, on a RULER case",
    )
    p.add_argument("--e2e-new-tokens", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--e2e-reps", type=int, default=3)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2])
    p.add_argument(
        "--policies",
        nargs="+",
        default=MAIN_POLICIES,
        help="run labels: a policy, 'name:field=value,...' (its options), '+dense0,1' to keep those "
        "layers dense (no selection), e.g. probe+dense0,1, and last '+every<k>' to choose blocks at most "
        "every k steps (SparseConfig.reselect_every; default 4), e.g. keykey+every1; --speed-policies "
        "takes the same labels",
    )
    p.add_argument(
        "--sweep-policies",
        nargs="+",
        default=None,
        help="policies run at every budget (default: all); the others run at --ablation-budget only",
    )
    p.add_argument("--ablation-budget", type=float, default=0.1, help="budget of the Key-Key ablation")
    p.add_argument("--no-ablation", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--paper-new-tokens", type=int, default=16, help="paperkeys: new tokens at most")
    p.add_argument("--heatmaps", type=int, default=1000, help="at most this many heat maps per length")
    p.add_argument("--no-overlap", action="store_true", help="skip the oracle-overlap measure (faster)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="suffix of the result files (sparse<tag>.json)")
    p.add_argument(
        "--speed-only",
        action="store_true",
        help="only the interleaved speed measurement (dense and each policy step by step, in turn)",
    )
    p.add_argument(
        "--speed-steps", type=int, default=16, help="decode steps per policy in the speed measurement"
    )
    p.add_argument(
        "--speed-policies", nargs="+", default=["keykey", "hybrid", "quest", "streaming", "snapkv"]
    )


@dataclass
class Run:
    """One decode of one case under one policy configuration."""

    label: str
    budget: float | None
    tokens: list[int]
    text: str
    step_s: list[float]
    stats: dict[str, Any] = field(default_factory=dict)
    overlap: float | None = None
    overlap_avg: float | None = None
    decoder: SparseDecoder | None = None


def _configs(args: argparse.Namespace) -> list[tuple[str, float, dict[str, Any]]]:
    sweep = set(args.policies if args.sweep_policies is None else args.sweep_policies)
    out = [
        (name, budget, {})
        for name in args.policies
        for budget in (args.budgets if name in sweep else [args.ablation_budget])
    ]
    if not args.no_ablation:
        out += [(label, args.ablation_budget, opts) for label, opts in ABLATIONS.items()]
    return out


DENSE_SUFFIX = "+dense"
EVERY_SUFFIX = "+every"
# a comma that starts the next "field=" of a run label's options (not one inside a tuple)
OPTION_SEPARATOR = re.compile(r",(?=\s*\w+\s*=)")


def split_dense_layers(label: str) -> tuple[str, tuple[int, ...]]:
    """A run label's policy part and the layers it keeps dense (attending to every row, no selection):
    "probe+dense0,1" -> ("probe", (0, 1)); a label without "+dense" -> (label, ())."""
    policy, found, layers = label.partition(DENSE_SUFFIX)
    if not found:
        return label, ()
    try:
        dense = tuple(int(item) for item in layers.split(","))
    except ValueError:
        raise ValueError(
            f"dense_layers of run label {label!r} must be layer indices after {DENSE_SUFFIX!r}, "
            "comma-separated (e.g. 'probe+dense0,1')"
        ) from None
    if any(i < 0 for i in dense) or len(set(dense)) != len(dense):
        raise ValueError(f"dense_layers of run label {label!r} must be distinct layer indices >= 0")
    return policy, tuple(sorted(dense))


def split_reselect_period(label: str) -> tuple[str, int | None]:
    """A run label without its last "+every<k>" and that k (``SparseConfig.reselect_every``):
    "keykey+every1" -> ("keykey", 1), "probe+dense0,1+every4" -> ("probe+dense0,1", 4); no suffix ->
    (label, None): the default period."""
    rest, found, period = label.rpartition(EVERY_SUFFIX)
    if not found:
        return label, None
    try:
        every = int(period)
    except ValueError:
        raise ValueError(
            f"reselect_every of run label {label!r} must be an int after {EVERY_SUFFIX!r} (e.g. 'keykey+every2')"
        ) from None
    if every < 1:
        raise ValueError(f"reselect_every of run label {label!r} must be >= 1, got {every}")
    return rest, every


def split_config_suffixes(label: str) -> tuple[str, dict[str, Any]]:
    """A run label's policy part and the :class:`SparseConfig` fields its suffixes set ("+dense<layers>",
    then "+every<k>"): "probe+dense0,1+every2" -> ("probe", {"dense_layers": (0, 1), "reselect_every": 2});
    a field without its suffix is left out (the config's default)."""
    policy, every = split_reselect_period(label)
    policy, dense = split_dense_layers(policy)
    fields: dict[str, Any] = {}
    if dense:
        fields["dense_layers"] = dense
    if every is not None:
        fields["reselect_every"] = every
    return policy, fields


def validate_labels(labels: list[str]) -> None:
    """Raise ValueError (naming the field) for a run label that ``make_decoder`` could not build, before
    any model is loaded."""
    for label in labels:
        policy, fields = split_config_suffixes(label)
        policy_from_label(policy, ABLATIONS.get(policy, {}))
        SparseConfig(**fields)


def policy_from_label(label: str, options: dict[str, Any]) -> SparsePolicy:
    """A policy from a run label: a registered name, a seed ablation ("keykey-..."), or a variant
    "name:field=value,field=value" (values as Python literals, tuples included), e.g.
    "probe:head_agg='mass'" or "probe:exact_layers=(3,4,5),exact_keys=True"."""
    if label.startswith("keykey-"):
        return KeyKeyPolicy(**options)
    name, _, variant = label.partition(":")
    for item in filter(None, OPTION_SEPARATOR.split(variant)):
        key, _, value = item.partition("=")
        try:
            options = {**options, key: ast.literal_eval(value)}
        except (ValueError, SyntaxError):
            raise ValueError(
                f"{key} of run label {label!r} must be a Python literal, got {value!r}"
            ) from None
    return make_policy(name, **options)


def make_decoder(engine, label: str, budget: float, options: dict[str, Any], **config: Any) -> SparseDecoder:
    """The engine's decoder (window layers on their window) for a run label of ``_configs``: a policy
    label of ``policy_from_label``, optionally followed by "+dense<layers>" (e.g. "probe+dense0,1") and
    then "+every<k>" (``reselect_every``, e.g. "keykey+every2")."""
    policy, fields = split_config_suffixes(label)
    return engine.sparse_decoder(policy_from_label(policy, options), budget, **{**config, **fields})


def decode_run(engine, base, steps: int, decoder: SparseDecoder | None) -> tuple:
    """Greedy decode ``steps`` tokens from a fork of the prefilled sequence ``base`` (the same first
    token for every policy); returns (tokens, per-step seconds, the fork's cache)."""
    seq = engine.fork(base, sparse=decoder)
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.decode_step(seq)
        step_s.append(time.perf_counter() - start)
    if decoder is not None:
        decoder.finish()
    return list(seq.tokens), step_s, seq.cache


def case_request(case: NeedleCase, max_new_tokens: int) -> GenerateRequest:
    """The case's prompt as plain text (see ``semkv.evaluation.needles``), greedy, fixed length, not stored."""
    return GenerateRequest(
        prompt=case.prompt,
        use_chat_template=False,
        max_new_tokens=max_new_tokens,
        stop_at_eos=False,
        store_prompt=False,
        reuse="none",
        sparse=None,  # each policy decodes from a fork
    )


def oracle_topk_per_step(decoder: SparseDecoder, cache, block_size: int, sink: int, window: int):
    """Per decode step: (candidates [C], per-layer true block mass [L, C])."""
    out = []
    for record, queries in zip(decoder.records, decoder.queries, strict=False):
        ctx = record.context_tokens
        win_block = max(0, (ctx - window) // block_size)
        first = min(sink, win_block)
        candidates = torch.arange(first, win_block)
        masses = [
            block_attention_mass(
                queries[layer].unsqueeze(1), cache.keys(layer)[:, :ctx], block_size, win_block
            )[candidates]
            for layer in range(cache.num_layers)
        ]
        out.append((candidates, torch.stack(masses)))
    return out


def overlap_scores(decoder: SparseDecoder, oracle: list) -> tuple[float, float]:
    """(mean per-layer overlap with that layer's top-k, mean overlap with the layer-averaged top-k)."""
    per_layer, averaged = [], []
    for record, (candidates, mass) in zip(decoder.records, oracle, strict=False):
        if not candidates.numel():
            continue
        layers = mass.shape[0]
        selected = record.selected if len(record.selected) == layers else record.selected * layers
        k = max(1, len(selected[0]))
        if k >= candidates.numel():
            continue
        avg_top = set(candidates[torch.topk(mass.mean(0), k).indices].tolist())
        for layer in range(layers):
            top = set(candidates[torch.topk(mass[layer], k).indices].tolist())
            chosen = set(selected[layer])
            per_layer.append(len(chosen & top) / k)
            averaged.append(len(chosen & avg_top) / k)
    return (statistics.fmean(per_layer) if per_layer else float("nan")), (
        statistics.fmean(averaged) if averaged else float("nan")
    )


def heatmap(path: Path, run: Run, oracle: list, needle_blocks: set[int], title: str) -> None:
    """Decode step x block: selected share over layers (grey), oracle top-k (red), needle (blue)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert run.decoder is not None
    records = run.decoder.records
    nb = max((int(c.max()) + 1 for c, _ in oracle if c.numel()), default=1)
    grid = torch.zeros(len(records), nb)
    for s, record in enumerate(records):
        for sel in record.selected:
            grid[s, sel] += 1.0 / len(record.selected)
    fig, ax = plt.subplots(figsize=(10, 2.8))
    ax.imshow(grid.numpy(), aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    for s, (candidates, mass) in enumerate(oracle):
        k = max(1, len(records[s].selected[0]))
        if candidates.numel() > k:
            top = candidates[torch.topk(mass.mean(0), k).indices]
            ax.scatter(
                top.numpy(),
                [s] * len(top),
                s=6,
                c="red",
                marker="s",
                label="oracle top-k" if s == 0 else None,
            )
    for b in sorted(needle_blocks):
        ax.axvline(b, color="blue", lw=1.0, alpha=0.7)
    ax.set_xlabel("block (blue: needle)")
    ax.set_ylabel("decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_case(engine, case: NeedleCase, args, configs, heat_dir: Path | None) -> tuple[list[Run], dict]:
    tokenizer, bs = engine.tokenizer, engine.block_size
    ids = prompt_ids(tokenizer, case)
    steps = args.max_new_tokens - 1
    base = engine.prefill(case_request(case, args.max_new_tokens + 1), capture_queries=True)
    prefill_s = base.ttft_s
    rows = answer_rows(tokenizer, ids, case.answer)
    needle_blocks = {r // bs for r in rows}
    info = {"prompt_tokens": len(ids), "prefill_s": prefill_s, "needle_blocks": sorted(needle_blocks)}
    runs = []
    dense_tokens, dense_steps, _ = decode_run(engine, base, steps, None)
    runs.append(
        Run(
            "dense", None, dense_tokens, tokenizer.decode(dense_tokens, skip_special_tokens=True), dense_steps
        )
    )
    sparse_cfg = SparseConfig(kv_budget=0.1)
    for label, budget, options in configs:
        decoder = make_decoder(engine, label, budget, options, record_queries=not args.no_overlap)
        tokens, step_s, cache = decode_run(engine, base, steps, decoder)
        run = Run(
            label,
            budget,
            tokens,
            tokenizer.decode(tokens, skip_special_tokens=True),
            step_s,
            decoder.stats(sum(step_s)),
            decoder=decoder,
        )
        if not args.no_overlap:
            oracle = oracle_topk_per_step(
                decoder, cache, bs, sparse_cfg.sink_blocks, sparse_cfg.window_tokens
            )
            run.overlap, run.overlap_avg = overlap_scores(decoder, oracle)
            if heat_dir is not None and label == "keykey" and budget == args.ablation_budget:
                heatmap(
                    heat_dir / f"case_{case.length}_{case.seed}.png",
                    run,
                    oracle,
                    needle_blocks,
                    f"{case.task} {case.length} tok, depth {case.depth:.2f}: keykey @ {budget:g} "
                    f"(dense: {'ok' if exact_match(runs[0].text, case.answer) else 'miss'}, "
                    f"keykey: {'ok' if exact_match(run.text, case.answer) else 'miss'})",
                )
        run.decoder = None
        del cache
        runs.append(run)
    return runs, info


def _ms(run: Run) -> float:
    timed = run.step_s[1:] if len(run.step_s) > 1 else run.step_s
    return 1000 * median(timed)


def _task_accuracy(tasks: list[str], correct: list[bool], dense_ok: list[bool], task: str) -> str:
    """'policy solved/cases (dense N)' on the cases of one task (per-case flags, same order)."""
    mine = [ok for t, ok in zip(tasks, correct, strict=True) if t == task]
    dense = [ok for t, ok in zip(tasks, dense_ok, strict=True) if t == task]
    return f"{sum(mine)}/{len(mine)} (dense {sum(dense)})"


def summarise(results: list[tuple[NeedleCase, list[Run], dict]]) -> list[dict[str, Any]]:
    """One row per (length, policy, budget): figures against dense on the same cases."""
    groups: dict[tuple, list[tuple[NeedleCase, Run, Run]]] = {}
    for case, runs, _info in results:
        dense = runs[0]
        for run in runs:
            groups.setdefault((case.length, run.label, run.budget), []).append((case, run, dense))
    rows = []
    for (length, label, budget), items in sorted(
        groups.items(), key=lambda x: (x[0][0], x[0][1], x[0][2] or 0)
    ):
        correct = [exact_match(r.text, c.answer) for c, r, _ in items]
        dense_ok = [exact_match(d.text, c.answer) for c, _, d in items]
        tasks = [c.task for c, _, _ in items]
        solved = [ok for ok, dok in zip(correct, dense_ok, strict=True) if dok]
        ratios = [_ms(d) / _ms(r) for _, r, d in items]
        stats = [r.stats for _, r, _ in items]
        row = {
            "length": length,
            "policy": label,
            "budget": budget if budget is not None else 1.0,
            "cases": len(items),
            "accuracy": 100 * statistics.fmean(correct),
            "dense_accuracy": 100 * statistics.fmean(dense_ok),
            **{f"{task}_accuracy": _task_accuracy(tasks, correct, dense_ok, task) for task in TASKS},
            "on_dense_solved": f"{sum(solved)}/{len(solved)}",
            "agree_dense": 100 * statistics.fmean(r.tokens == d.tokens for _, r, d in items),
            "ms_per_token": median([_ms(r) for _, r, _ in items]),
            "speedup_vs_dense": median(ratios),
        }
        if label != "dense":
            overlaps = [r.overlap for _, r, _ in items if r.overlap is not None]
            avg = [r.overlap_avg for _, r, _ in items if r.overlap_avg is not None]
            row.update(
                {
                    "oracle_overlap": statistics.fmean(overlaps) if overlaps else float("nan"),
                    "oracle_overlap_avg": statistics.fmean(avg) if avg else float("nan"),
                    "select_share": median([s.get("select_share", 0.0) for s in stats]),
                    "resident_kv_MB": statistics.fmean((s.get("resident_kv_bytes") or 0) for s in stats)
                    / 1e6,
                    "loaded_per_step": statistics.fmean(s.get("blocks_loaded_per_step", 0.0) for s in stats),
                    "blocks_per_step": statistics.fmean(
                        s.get("blocks_selected_per_step", 0.0) for s in stats
                    ),
                }
            )
        rows.append(row)
    return rows


COLUMNS = [
    "length",
    "policy",
    "budget",
    "cases",
    "accuracy",
    "dense_accuracy",
    "passkey_accuracy",
    "multifact_accuracy",
    "on_dense_solved",
    "agree_dense",
    "oracle_overlap",
    "oracle_overlap_avg",
    "ms_per_token",
    "speedup_vs_dense",
    "select_share",
    "resident_kv_MB",
    "loaded_per_step",
    "blocks_per_step",
]


def _plots(out: Path, name: str, rows: list[dict[str, Any]]) -> None:
    for length in sorted({r["length"] for r in rows}):
        for metric, ylabel in (
            ("accuracy", "accuracy (%)"),
            ("speedup_vs_dense", "decode speed-up vs dense"),
        ):
            series = {}
            for policy in MAIN_POLICIES:
                pts = sorted(
                    (r["budget"], r[metric]) for r in rows if r["length"] == length and r["policy"] == policy
                )
                if pts:
                    series[policy] = ([p[0] for p in pts], [p[1] for p in pts])
            if series:
                line_plot(
                    out / f"{name}_{metric}_{length}.png",
                    series,
                    "KV budget (fraction of context)",
                    ylabel,
                    f"sparse decode, {length} tokens",
                )


def interleaved_speed(engine, case: NeedleCase, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Decode dense and every policy in turn, one step each, rotating the order every step, so a
    machine whose load changes by the second slows all of them alike. Ratios are per step pair."""
    ids = prompt_ids(engine.tokenizer, case)
    base = engine.prefill(case_request(case, args.speed_steps + 2), capture_queries=True)
    labels = ["dense", *args.speed_policies]
    decoders = {
        label: None if label == "dense" else make_decoder(engine, label, args.ablation_budget, {})
        for label in labels
    }
    seqs = {label: engine.fork(base, sparse=decoders[label]) for label in labels}
    times: dict[str, list[float]] = {label: [] for label in labels}
    for step in tqdm(range(args.speed_steps), desc=f"interleaved speed {len(ids)} tok", unit="step"):
        for label in labels[step % len(labels) :] + labels[: step % len(labels)]:
            start = time.perf_counter()
            engine.decode_step(seqs[label])
            times[label].append(time.perf_counter() - start)
    rows = []
    dense = times["dense"][1:]
    for label in labels:
        timed = times[label][1:]  # the first step builds the summaries of the prompt's blocks
        decoder = decoders[label]
        stats = decoder.stats(sum(timed)) if decoder is not None else {}
        steady = decoder.records[1:] if decoder is not None else []
        rows.append(
            {
                "length": len(ids),
                "policy": label,
                "budget": args.ablation_budget if decoder is not None else 1.0,
                "steps": len(timed),
                "ms_per_token": 1000 * median(timed),
                "speedup_vs_dense": median([d / t for d, t in zip(dense, timed, strict=True)]),
                "select_share": (sum(r.select_s for r in steady) / sum(timed)) if steady else 0.0,
                "move_share": (sum(r.gather_s for r in steady) / sum(timed)) if steady else 0.0,
                "prepare_s": stats.get("prepare_s", 0.0),
                "resident_kv_MB": (stats.get("resident_kv_bytes") or 0) / 1e6,
                "dense_kv_MB": base.cache.nbytes() / 1e6,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    from semkv.engine import Engine

    validate_labels([label for label, _, _ in _configs(args)] + list(args.speed_policies))
    if args.suite == "paperkeys":
        from semkv.bench import sparse_paperkeys

        return sparse_paperkeys.run(args, _configs(args), make_decoder)
    if args.suite == "ruler" or args.e2e:
        from semkv.bench import sparse_ruler

        if args.e2e:
            return sparse_ruler.run_e2e(args, make_decoder)
        return sparse_ruler.run(args, _configs(args), make_decoder)
    torch.set_num_threads(args.threads or 1)
    engine = Engine.from_args(args, threads=args.threads or 1)
    out = Path(args.out)
    name = f"sparse{args.tag}"
    heat_dir = out / f"{name}_heatmaps"
    heat_dir.mkdir(parents=True, exist_ok=True)
    if args.speed_only:
        rows = []
        for length in args.lengths:
            case = make_cases(engine.tokenizer, length, 1, seed=args.seed)[0]
            rows += interleaved_speed(engine, case, args)
            write_results(out, f"{name}_speed", rows, vars_config(args), notes=SPEED_NOTES)
        print((out / f"{name}_speed.md").read_text())
        return 0
    configs = _configs(args)
    # warm-up (excluded): one short prefill + decodes through the sparse path
    warm = make_cases(engine.tokenizer, 512, 1, seed=args.seed + 99)[0]
    run_case(engine, warm, argparse.Namespace(**{**vars(args), "no_overlap": True}), configs[:2], None)
    results = []
    per_case = []
    for length in args.lengths:
        cases = make_cases(engine.tokenizer, length, args.cases, seed=args.seed)
        for i, case in enumerate(tqdm(cases, desc=f"sparse {length} tok", unit="case")):
            runs, info = run_case(engine, case, args, configs, heat_dir if i < args.heatmaps else None)
            results.append((case, runs, info))
            per_case.append(
                {
                    "length": length,
                    "task": case.task,
                    "seed": case.seed,
                    "depth": case.depth,
                    "answer": case.answer,
                    **info,
                    "runs": {
                        f"{r.label}@{r.budget}": {"text": r.text, "ms": _ms(r), **r.stats} for r in runs
                    },
                }
            )
            rows = summarise(results)
            write_results(out, name, rows, vars_config(args), COLUMNS, extra={"cases": per_case}, notes=NOTES)
    _plots(out, name, rows)
    print((out / f"{name}.md").read_text())
    return 0


def vars_config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("bench_run", "func")}


NOTES = """
Columns: accuracy = answer found in the generated text; dense_accuracy = dense on the same cases;
passkey_accuracy / multifact_accuracy = solved / cases of that task (and dense's count on them);
on_dense_solved = cases dense solves that the policy also solves; agree_dense = identical tokens;
oracle_overlap = |selected ∩ true-attention top-k| / k per layer and step (middle blocks only);
oracle_overlap_avg = the same against the top-k of attention averaged over layers and heads (the
seed's section 3.3 measure); speedup_vs_dense = median over cases of dense ms/token / policy ms/token
(same run, same prefilled cache); select_share = selection time / decode time; resident_kv_MB = fast-tier
KV at rest after the last step; loaded_per_step = blocks (all layers) copied from the slow tier per step
after the first. Budgets count the selected middle blocks; the sink block and the ~32-token window come on top.
"""

SPEED_NOTES = """
Interleaved: dense and each policy decode one step each in turn (order rotated every step) from
copies of one prefilled cache; speedup_vs_dense = median over steps of dense step time / policy step
time. select_share / move_share: selection / fast-tier movement time over decode time (steady
steps). prepare_s: building the prompt blocks' summaries once (the work done when blocks are written).
"""
