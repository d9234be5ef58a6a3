"""The sparse-decode policy interface.

A policy answers one question per decode step (or per layer of a step): how
relevant is each candidate block? It overrides one method, :meth:`SparsePolicy.score`,
and returns a score per candidate block (``-inf`` = never select). Everything
else — the budget, the always-kept sink block(s) and local window, the top-k, the
two-tier residency and the statistics — lives in :class:`semkv.sparse.decoder.SparseDecoder`,
so every policy is compared at the same block granularity and budget.

Blocks are ``block_size`` consecutive cache rows: block ``b`` = rows
``[b * block_size, (b + 1) * block_size)``. A block is a *candidate* once it is
complete and outside the sink and the local window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from semkv.models.cache import KVCache

if TYPE_CHECKING:
    from semkv.sparse.index import BlockIndex, PrefillQueries


@dataclass
class StepView:
    """What a policy sees when it scores blocks.

    cache: the live cache (the slow tier: every row of every layer).
    index: per-block summaries kept up to date by the decoder.
    candidates: [C] block ids eligible for selection (ascending).
    budget: number of candidate blocks the decoder will keep this step.
    step: decode step (0 = the first generated token after the prompt's first).
    layer: the layer being scored (per-layer policies), None for a once-per-step choice.
    q_rot: [nh, 1, d] rotated query of ``layer`` (per-layer policies only).
    prefill: queries captured during prefill (SnapKV, H2O), or None.
    selecting: the layers that attend to selected blocks (not window or dense layers).
    group: the layers that share this selection (per-group policies).
    span: ``candidates`` as a slice of block ids, or None (then read from ``candidates``).
    """

    cache: KVCache
    index: BlockIndex
    candidates: Tensor
    budget: int
    step: int
    layer: int | None = None
    q_rot: Tensor | None = None
    prefill: PrefillQueries | None = None
    selecting: tuple[int, ...] = ()
    group: tuple[int, ...] = ()
    span: slice | None = None

    def candidate_span(self) -> slice:
        """The candidates as a slice of block ids (they are always a contiguous range; ``span`` when the
        decoder gave it, which saves reading the tensor)."""
        if self.span is not None:
            return self.span if self.span.stop > self.span.start else slice(0, 0)
        if self.candidates.numel() == 0:
            return slice(0, 0)
        return slice(int(self.candidates[0]), int(self.candidates[-1]) + 1)


@dataclass
class SparsePolicy:
    """Base class: one small dataclass per policy, one method to override.

    Optional hooks (default: nothing): :meth:`prepare` once after prefill,
    :meth:`observe` after a layer's selection (H2O accumulates attention there),
    :meth:`see_query` with each selecting layer's query of the step (after the step's selection),
    :meth:`resident_hint` (which unselected blocks are worth keeping in the fast tier).
    """

    name: ClassVar[str] = ""
    needs_prefill_queries: ClassVar[bool] = False

    @property
    def per_layer(self) -> bool:
        """True: :meth:`score` is called per layer with that layer's query; False: once per step."""
        return False

    @property
    def is_dense(self) -> bool:
        return False

    def layer_groups(self, selecting: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Layers that share one selection, in order: one group of every selecting layer (chosen once per
        step, before layer 0 attends) unless :attr:`per_layer` (one group per layer). A policy may return
        other groups: each is then chosen at its first layer, with that layer's query."""
        return tuple((layer,) for layer in selecting) if self.per_layer else (selecting,)

    def score(self, view: StepView) -> Tensor:
        """Scores [C] for ``view.candidates`` (higher = more relevant; -inf = exclude)."""
        raise NotImplementedError

    def prepare(self, view: StepView) -> None:  # noqa: B027 - optional hook
        """Called once before the first decode step (``view.candidates`` are the prompt's)."""

    def observe(self, view: StepView, selected: Tensor, keys: Tensor, k_pos: Tensor) -> None:  # noqa: B027
        """Called after a layer chose ``selected`` blocks; ``keys`` [kvh, R, d] are what it attends to."""

    def see_query(self, layer: int, q_rot: Tensor) -> None:  # noqa: B027 - optional hook
        """The rotated query [nh, 1, d] of ``layer`` at this step (called for the selecting layers only)."""

    def resident_hint(self) -> Tensor | None:
        """Bool mask over all blocks: worth keeping resident although unselected (None: nothing)."""
        return None

    def describe(self) -> dict[str, Any]:
        """The policy's settings, for reports."""
        out: dict[str, Any] = {"policy": self.name}
        for key, value in self.__dict__.items():
            if not key.startswith("_") and isinstance(value, (int, float, str, bool, tuple, type(None))):
                out[key] = value
        return out


@dataclass
class Budget:
    """How many blocks a step attends to besides the sink and the window.

    kv_budget: a fraction of the context in (0, 1] or a token count (int >= 1).
    min_tokens: never fewer than this many tokens (0: no floor). A fraction of a short context is a few
        blocks, too few to hold what the question needs (``SparseConfig.min_kept_tokens``).
    """

    kv_budget: float | int = 0.1
    min_tokens: int = 0

    def __post_init__(self) -> None:
        value = self.kv_budget
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"kv_budget must be a fraction in (0, 1] or a token count, got {value!r}")
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"kv_budget as a token count must be >= 1, got {value}")
        elif not 0.0 < value <= 1.0:
            raise ValueError(f"kv_budget as a fraction must be in (0, 1], got {value}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_kept_tokens must be an int >= 0, got {self.min_tokens!r}")

    def blocks(self, context_tokens: int, block_size: int) -> int:
        """Blocks selectable for a context of ``context_tokens`` tokens (rounded up; at least
        ``min_tokens`` tokens' worth)."""
        tokens = self.kv_budget if isinstance(self.kv_budget, int) else self.kv_budget * context_tokens
        tokens = max(int(round(tokens)), self.min_tokens)
        return max(1, -(-tokens // block_size))


def topk_blocks(scores: Tensor, candidates: Tensor, k: int) -> Tensor:
    """The ``k`` best candidates (ascending block ids), skipping -inf scores. scores, candidates: [C]."""
    if k >= candidates.numel():
        keep = torch.isfinite(scores) | (scores > 0)
        return candidates[keep]
    values, order = torch.topk(scores, k)
    return candidates[order[torch.isfinite(values)]].sort().values


@dataclass
class StepRecord:
    """Per-step statistics of a sparse decode (filled by the decoder)."""

    step: int
    context_tokens: int
    selected: list[list[int]] = field(default_factory=list)  # per layer (one entry if per-step)
    loaded_blocks: int = 0
    resident_blocks: int = 0
    select_s: float = 0.0
    gather_s: float = 0.0
    summarise_s: float = 0.0  # summarising a block the previous step completed
