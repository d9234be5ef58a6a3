"""The options of the reuse paths, as typed dataclasses that import no request, engine or path.

:class:`BlendConfig` (CacheBlend) and :class:`ShareConfig` (SemShareKV) are what a user passes per
request (``engine.generate(blend=..., share=...)``) or what calibration puts in the engine's defaults;
:class:`ReuseOptions` is one request's resolved choice that the paths read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from semkv.reuse.lsh import SimHashConfig
from semkv.reuse.selection.base import RowSelector
from semkv.reuse.selection.query import QuerySelector
from semkv.reuse.selection.registry import make_selector
from semkv.reuse.selective import DeviationOn
from semkv.store.keys import DEFAULT_NAMESPACE, Namespace
from semkv.validation import check_bool, check_choice, check_int, check_number

DEVIATIONS: tuple[str, ...] = ("k", "v", "kv")
MAX_LAYERS = 1024  # bounds of the knobs a request may set (see semkv.validation)
MAX_TOKENS = 1_000_000
MAX_ANCHOR = 64
MAX_CANDIDATES = 16


def check_fraction(name: str, value: object) -> float:
    """``value`` as a float in [0, 1]; a ValueError naming ``name`` otherwise (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


SinkMode = Literal["template", "bos", "none"]
SINK_MODES: tuple[str, ...] = ("template", "bos", "none")


@dataclass(frozen=True)
class BlendConfig:
    """How a blend recomputes.

    recompute_ratio: fraction of the *cached* chunk tokens recomputed after the check layer
        (uncached tokens are always recomputed). 0 = full reuse (naive concatenation of the
        stored caches), 1 = every token recomputed (= full prefill).
    selector: which cached tokens: a name from :data:`semkv.reuse.selection.registry.SELECTORS`
        ("deviation": CacheBlend's KV deviation; "query": the question's attention; "query+deviation";
        "chunk-start": the first k tokens of every chunk; "random"), a dict ``{"name": ..., <its
        options>}`` or a :class:`~semkv.reuse.selection.base.RowSelector`. Every selector takes the
        APE-style attention scaling options ``temperature`` and ``scale`` (in (0, 2]).
    check_layer: the layer where the selection is made (layers before it recompute every token).
        None (default) = the selector's own: 1 for selectors that rank by KV deviation (layer 0's KV
        depends on the token alone, so they need layer 1), 0 for the others (their ranking is known
        before the forward, and a cached row's layer-0 KV equals its reused KV, so running layer 0 on
        it is wasted). A later check layer costs time (every layer before it recomputes every token)
        and did not bring the blend closer to full prefill (docs/history/measurements.md).
    gradual: the paper's gradual filtering: keep 2r at the check layer, 1.5r at the next,
        r from the one after (each step picks from the survivors by their new score). Off by default:
        it was no closer to full prefill than one selection.
    sink: how chunks are precomputed (see the module docstring): after BOS (default), after
        the default chat-template prefix, or alone.
    separator_in_chunk: a chunk is precomputed and stored with the separator that follows it in every
        prompt (:data:`semkv.prompt.CHUNK_SEPARATOR`), so the separators' KV is reused (and ranked for
        recompute) like the chunk's own tokens; off, the separators are uncached rows, computed in the
        probe and recomputed at every layer like the question. On by default: fewer rows to probe and
        recompute, so a shorter TTFT, with no loss against full prefill (docs/history/measurements.md,
        "Separators stored with their chunk"). Selectors that rank by KV deviation recompute the
        separators either way (``RowSelector.recomputes_separators``): reused, they moved those
        selectors further from full prefill.
    """

    recompute_ratio: float = 0.15
    selector: RowSelector | str | dict[str, Any] = field(default_factory=QuerySelector)
    check_layer: int | None = None
    gradual: bool = False
    sink: SinkMode = "bos"
    separator_in_chunk: bool = True

    def __post_init__(self) -> None:
        check_fraction("recompute_ratio", self.recompute_ratio)
        try:
            object.__setattr__(self, "selector", make_selector(self.selector))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"blend selector: {exc}") from None
        if self.check_layer is None:
            object.__setattr__(self, "check_layer", 1 if self.selector.uses_deviation else 0)
        check_int("check_layer", self.check_layer, 0, MAX_LAYERS)
        if self.check_layer == 0 and self.selector.uses_deviation:
            raise ValueError(
                f"check_layer 0 cannot rank by KV deviation (layer 0's KV depends on the token alone); "
                f"selector {self.selector.name!r} needs check_layer >= 1"
            )
        check_bool("gradual", self.gradual)
        check_choice("sink", self.sink, SINK_MODES)
        check_bool("separator_in_chunk", self.separator_in_chunk)

    def schedule(self, num_layers: int) -> dict[int, float]:
        """layer -> fraction of cached rows kept from that layer on (for :class:`SelectiveRecompute`)."""
        r = float(self.recompute_ratio)
        if r == 0.0:
            # Nothing cached is recomputed anywhere: drop the cached rows at layer 0 (whose KV
            # depends on the token alone), which is exactly a naive concatenation of the caches.
            return {0: 0.0}
        last = num_layers - 1
        if not self.gradual:
            return {min(self.check_layer, last): r}
        steps = (min(1.0, 2 * r), min(1.0, 1.5 * r), r)
        out: dict[int, float] = {}
        for i, ratio in enumerate(steps):
            out[min(self.check_layer + i, last)] = ratio
        return out


@dataclass
class ShareConfig:
    """Options of the share path (``engine.generate(..., share=ShareConfig(...))``).

    min_tokens: prompts shorter than this are neither remembered nor served by sharing.
    min_similarity: the index's estimated Jaccard similarity (token bigram sets) a reference needs.
    min_match_rate: share of the new prompt's tokens matched in aligned runs a reference needs. 0.6
        is set from ``semkv bench share`` on SmolLM2: below it quality still held but the speed-up over
        full prefill fell under 2x, so sharing is refused there as not worth it.
    min_token_similarity: bit agreement a signature match needs (step 3 of the matching).
    min_aligned_after_prefix: aligned tokens needed after the leading run identical to the reference;
        fewer means exact prefix reuse does (nearly) as well, exactly, and share is refused.
    anchor: length of the n-gram anchors that start an aligned run.
    schedule: "exponential" (ratio first_ratio * decay^(layer-1), floored at min_ratio) or
        "constant" (constant_ratio at every layer). Ratios are fractions of the reused rows
        recomputed from layer 1 on; layer 0 recomputes the rows ``layer0_window`` picks, and the forced rows (unmatched
        and scattered tokens, the last ``recompute_last``) at every layer besides the ratio. The
        defaults (0.1, 0.6, 0.01) were chosen on aclsum's val split (SmolLM2 bf16, 8 papers, 10% and
        30% of sentences edited) over the earlier (0.2, 0.8, 0.02): a fifth fewer recomputed rows at 10%
        edits, first-token KL to full prefill not measurably worse (docs/benchmarks.md, Share).
    deviation_on: which fresh-vs-reused deviation ranks the rows ("k", "v" or "kv").
    unmatched: "recompute" (SemShareKV) or "drop" (the paper's elimination baseline).
    scattered: what to do with tokens matched outside an aligned run (same id elsewhere, or by
        signature): "reuse" their matched KV like the paper (and let the deviation check pick them),
        or "recompute" them like unmatched tokens (their reused KV comes from another context). The
        default recomputes: on SmolLM2 reusing them cost far more quality (first-token KL to full
        prefill) than recomputing them costs time.
    recompute_last: the prompt's last tokens (the generation prompt) are always recomputed: an aligned
        match there (the chat template's closing tokens) reuses KV computed after other text, and the
        next-token distribution depends on these tokens most.
    layer0_window: which reused rows layer 0 recomputes. 0: every row (the paper: layer 1's deviation is
        then measured for every row). n > 0: only the rows at most n - 1 tokens after a break in the
        alignment (a forced row, or a row whose reference row does not follow the one before's), the
        forced rows among them; every other row keeps its reused KV at every layer (a token far from any
        change sees, through layer 0's attention, what it saw in the reference), and the deviation ranks
        only the rows near a change. Layer 0's cost then scales with what changed, not with the prompt.
        The default 32 was chosen on aclsum's val split (SmolLM2 and Gemma 3 bf16, 10% and 30% of
        sentences edited) over 0, 8, 16 and 64: faster first hits at 10% edits with no first-token KL
        difference from 0 the paired intervals can tell (docs/benchmarks.md, Share).
    candidates: index hits tried in order (a hit whose KV left the store is dropped from the index).
    simhash: token signature settings (stored with every prompt; a mismatch re-hashes the reference).
    min_new_fraction: an exactly prefilled prompt is remembered (its whole KV stored and indexed) only
        if at least this share of it was computed, not loaded as a stored exact prefix. A prompt that
        only extends a stored one (a chat follow-up, one more question on the same document) adds
        little to share from: a prompt like it shares the prefix's owner or hits the prefix blocks, and
        storing it would cost more than its prefill did. 0 remembers every prompt.
    """

    min_tokens: int = 64
    min_similarity: float = 0.2
    min_match_rate: float = 0.6
    min_token_similarity: float = 0.8
    min_aligned_after_prefix: int = 32
    anchor: int = 4
    schedule: Literal["exponential", "constant"] = "exponential"
    first_ratio: float = 0.1
    decay: float = 0.6
    min_ratio: float = 0.01
    constant_ratio: float = 0.04
    deviation_on: DeviationOn = "kv"
    unmatched: Literal["recompute", "drop"] = "recompute"
    scattered: Literal["reuse", "recompute"] = "recompute"
    recompute_last: int = 16
    layer0_window: int = 32
    candidates: int = 3
    simhash: SimHashConfig = field(default_factory=SimHashConfig)
    min_new_fraction: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.simhash, dict):
            self.simhash = SimHashConfig(**self.simhash)
        if not isinstance(self.simhash, SimHashConfig):
            raise ValueError(f"simhash must be a SimHashConfig or a dict, got {type(self.simhash).__name__}")
        check_int("min_tokens", self.min_tokens, 2, MAX_TOKENS)
        for name in (
            "min_similarity",
            "min_match_rate",
            "min_token_similarity",
            "first_ratio",
            "min_ratio",
            "constant_ratio",
            "min_new_fraction",
        ):
            check_fraction(name, getattr(self, name))
        check_number("decay", self.decay, 0.0, 1.0, low_open=True)
        check_choice("schedule", self.schedule, ("exponential", "constant"))
        check_choice("unmatched", self.unmatched, ("recompute", "drop"))
        check_choice("scattered", self.scattered, ("reuse", "recompute"))
        check_choice("deviation_on", self.deviation_on, DEVIATIONS)
        check_int("min_aligned_after_prefix", self.min_aligned_after_prefix, 0, MAX_TOKENS)
        check_int("recompute_last", self.recompute_last, 1, MAX_TOKENS)
        check_int("layer0_window", self.layer0_window, 0, MAX_TOKENS)
        check_int("anchor", self.anchor, 1, MAX_ANCHOR)
        check_int("candidates", self.candidates, 1, MAX_CANDIDATES)

    def ratios(self, num_layers: int) -> dict[int, float]:
        """layer -> recompute ratio for layers 1..num_layers-1 (non-increasing)."""
        if self.schedule == "constant":
            return {layer: self.constant_ratio for layer in range(1, num_layers)}
        return {
            layer: max(self.min_ratio, self.first_ratio * self.decay ** (layer - 1))
            for layer in range(1, num_layers)
        }

    def mean_recompute(self, num_layers: int) -> float:
        """Expected share of reused-row layer passes recomputed (layer 0 counts fully: an upper bound where
        ``layer0_window`` leaves rows out of it)."""
        return (1.0 + sum(self.ratios(num_layers).values())) / num_layers


@dataclass(frozen=True)
class ReuseOptions:
    """One request's reuse choice with the engine's defaults applied (what the paths read).

    mode: "auto", "none" or a path name (the request's ``reuse``).
    blend / share: the configs the blend and share paths use for this request.
    namespace: whose cache the request reads and writes (tenant + cache salt): every store key, the
        share index and stored chunks are scoped by it (chunks are also read from the shared namespace).
    """

    mode: str = "auto"
    blend: BlendConfig = field(default_factory=BlendConfig)
    share: ShareConfig = field(default_factory=ShareConfig)
    namespace: Namespace = DEFAULT_NAMESPACE
