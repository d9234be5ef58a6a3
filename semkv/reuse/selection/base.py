"""The row-selection interface of selective recompute.

A selective recompute (CacheBlend's blend, SemShareKV's share) pre-loads reused KV into the cache
rows and runs :meth:`semkv.models.runtime.Runtime.forward_rows`; at the check layer(s) it keeps the
``forced`` rows (uncached tokens: template, separators, question) and a budget of the reusable rows,
and the rest keep their reused KV from then on. *Which* reusable rows is the policy: a
:class:`RowSelector` overrides one method, :meth:`RowSelector.score`, returning a score per candidate
row (higher = recompute first; ``-inf`` = never). The budget, the top-k, the forced rows and the
bookkeeping live in :class:`semkv.reuse.selective.SelectiveRecompute`, so every policy is compared at
the same budget.

Every selector also carries the APE-style attention scaling options (``temperature``, ``scale``; see
:class:`ContextScaling`), applied to the rows after the context (the question and the generation
prompt) whatever the selector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

from semkv.models.kernels import GemmPlans, visible_keys
from semkv.models.runtime import LayerInputs, attention


def check_scaling(name: str, value: object) -> float:
    """``value`` as a float in (0, 2]; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 2.0:
        raise ValueError(f"{name} must be a number in (0, 2], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RowInfo:
    """What each row of a selective recompute is (all [T] over the rows ``forward_rows`` computes).

    forced: bool, always recomputed (no reused KV).
    query: bool, the rows whose attention ranks the context (the question and the generation prompt).
    chunk_offset: long, the row's offset inside its context chunk; -1 outside chunks.
    settled: bool, rows whose KV is already final at every layer (computed in place by a query probe):
        neither recomputed nor candidates after the check layer. None: no row.
    """

    forced: Tensor
    query: Tensor
    chunk_offset: Tensor
    settled: Tensor | None = None

    def __post_init__(self) -> None:
        n = self.forced.numel()
        if self.settled is None:
            object.__setattr__(self, "settled", torch.zeros_like(self.forced, dtype=torch.bool))
        if self.query.numel() != n or self.chunk_offset.numel() != n or self.settled.numel() != n:
            raise ValueError("forced, query, chunk_offset and settled must cover the same rows")
        if bool((self.settled & self.forced).any()):
            raise ValueError("a row cannot be both forced and settled")

    @property
    def reusable(self) -> Tensor:
        """[T] bool: the rows holding reused KV (neither forced nor settled): the candidates."""
        return ~(self.forced | self.settled)

    @classmethod
    def plain(cls, forced: Tensor) -> RowInfo:
        """Rows with no layout known: no query rows, no chunks (deviation and random selectors only)."""
        forced = forced.bool()
        return cls(
            forced,
            torch.zeros_like(forced),
            torch.full(forced.shape, -1, dtype=torch.long, device=forced.device),
        )


@dataclass
class ScoreView:
    """What a selector sees when it scores the candidates at one check layer.

    layer: the check layer. active: [A] row offsets computed at this layer (ascending).
    candidates: [C] indices into ``active`` of the reusable rows that may be kept.
    budget: how many of them will be kept. rows: the request's :class:`RowInfo`.
    fresh_k, cached_k: [kvh, A, d] pre-RoPE keys (this forward / reused); fresh_v, cached_v: values.
    inputs: the layer's queries and keys. probe: [T] per-row scores a probe pass recorded before the
    forward (:class:`semkv.reuse.selective.QueryProbe`), or None. The fresh / cached KV and ``inputs`` are
    None when the choice is made before the forward (check layer 0 of a selector that does not use
    deviation: :meth:`semkv.reuse.selective.SelectiveRecompute.preselect`).
    """

    layer: int
    active: Tensor
    candidates: Tensor
    budget: int
    rows: RowInfo
    fresh_k: Tensor | None
    fresh_v: Tensor | None
    cached_k: Tensor | None
    cached_v: Tensor | None
    inputs: LayerInputs | None
    probe: Tensor | None = None

    @property
    def candidate_rows(self) -> Tensor:
        """[C] row offsets of the candidates."""
        return self.active[self.candidates]

    def deviation(self, on: str) -> Tensor:
        """[C] L2 deviation of the candidates' fresh KV from their reused KV ("k", "v" or "kv")."""
        c = self.candidates
        if self.fresh_k is None or self.fresh_v is None or self.cached_k is None or self.cached_v is None:
            raise RuntimeError(
                "KV deviation needs the forward's KV (uses_deviation) but the choice was made before it"
            )
        return kv_deviation(
            self.fresh_k[:, c], self.fresh_v[:, c], self.cached_k[:, c], self.cached_v[:, c], on
        )

    def probe_scores(self) -> Tensor:
        """[C] the probe pass's scores of the candidates."""
        if self.probe is None:
            raise RuntimeError("this selector needs a probe pass (needs_probe) but none ran")
        return self.probe[self.candidate_rows]


def kv_deviation(fresh_k: Tensor, fresh_v: Tensor, cached_k: Tensor, cached_v: Tensor, on: str) -> Tensor:
    """Per-row L2 deviation [A] between fresh and reused KV (each [kvh, A, d])."""
    parts = []
    if on in ("k", "kv"):
        parts.append((fresh_k - cached_k).pow(2).sum(dim=(0, 2)))
    if on in ("v", "kv"):
        parts.append((fresh_v - cached_v).pow(2).sum(dim=(0, 2)))
    return torch.stack(parts).sum(0).sqrt()


def shares(scores: Tensor) -> Tensor:
    """Non-negative scores [C] as shares of their total (all zeros stay zeros)."""
    scores = scores.clamp_min(0.0)
    total = scores.sum()
    return scores / total if float(total) > 0 else scores


@dataclass(frozen=True)
class RowSelector:
    """Base class: one small frozen dataclass per policy, one method to override (:meth:`score`).

    temperature, scale: APE-style attention scaling of the rows after the context (question and
    generation prompt), in (0, 2]; 1 and 1 = off. See :class:`ContextScaling`.
    """

    name: ClassVar[str] = ""
    needs_probe: ClassVar[bool] = False  # True: the path runs a QueryProbe pass first (view.probe)
    uses_deviation: ClassVar[bool] = False  # True: ranks by fresh-vs-reused KV (meaningless at layer 0)

    temperature: float = 1.0
    scale: float = 1.0

    def __post_init__(self) -> None:
        check_scaling("temperature", self.temperature)
        check_scaling("scale", self.scale)

    def score(self, view: ScoreView) -> Tensor:
        """Scores [C] for ``view.candidates`` (higher = recompute first; -inf = never)."""
        raise NotImplementedError

    def probe_layers(self, windows: Sequence[int | None]) -> tuple[int, ...]:
        """Layers whose query attention the probe pass records (selectors with ``needs_probe``), on a model
        whose layer ``i`` has sliding window ``windows[i]`` (None: a global layer)."""
        return ()

    @property
    def keeps_probe_rows(self) -> bool:
        """True: the uncached rows other than the question keep the KV the probe pass computed for them
        (:class:`semkv.reuse.selective.QueryProbe`) instead of being recomputed."""
        return False

    @property
    def recomputes_separators(self) -> bool:
        """True: the separators between chunks are forced rows (recomputed at every layer) even when they are
        stored with their chunk (``BlendConfig.separator_in_chunk``): the selectors that rank by KV
        deviation (see :class:`semkv.reuse.options.BlendConfig`)."""
        return self.uses_deviation

    @property
    def scales_attention(self) -> bool:
        return self.temperature != 1.0 or self.scale != 1.0

    def describe(self) -> dict[str, Any]:
        """The selector's name and settings (JSON-ready; what ``make_selector`` takes back)."""
        out: dict[str, Any] = {"name": self.name}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class ContextScaling:
    """APE-style attention scaling for the rows after the context, as a drop-in for
    :func:`semkv.models.runtime.attention` (``forward_rows`` calls a selector's ``attention``).

    For a query row at or after ``context_end`` (a position), the logits of its attention to context
    keys (``context`` positions: the chunk rows) are divided by ``temperature`` and the context part's
    weight is multiplied by ``scale`` (``log(scale)`` added to every context logit, i.e. to the part's
    log-sum-exp), then one softmax runs over all keys it may see. Other rows attend as usual.
    """

    context: Tensor  # long [P] positions of context rows (sorted)
    context_end: int
    temperature: float
    scale: float

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        scaling: float,
        window: int | None = None,
        causal_prefix: bool = False,
        plans: GemmPlans | None = None,
    ) -> Tensor:
        out = attention(q, k, v, q_pos, k_pos, scaling, window, causal_prefix, plans=plans)
        late = (q_pos >= self.context_end).nonzero().squeeze(1)
        if late.numel() == 0:
            return out
        out[late] = scaled_attention(
            q[:, late],
            k,
            v,
            q_pos[late],
            k_pos,
            scaling,
            window,
            torch.isin(k_pos, self.context),
            self.temperature,
            self.scale,
        )
        return out


def scaled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scaling: float,
    window: int | None,
    context: Tensor,
    temperature: float,
    scale: float,
) -> Tensor:
    """Attention with the context keys' logits divided by ``temperature`` and their weight times ``scale``.

    q: [nh, Tq, d]; k, v: [kvh, Tk, d]; q_pos [Tq]; k_pos [Tk]; context: bool [Tk]. For few query rows
    (it materialises the [nh, Tq, Tk] logits). Returns [Tq, nh * d] like ``attention``.
    """
    nh, tq, d = q.shape
    kvh = k.shape[0]
    rep = nh // kvh
    logits = torch.matmul(q.reshape(kvh, rep * tq, d), k.transpose(1, 2)) * scaling  # [kvh, rep*tq, Tk]
    logits = logits.reshape(kvh, rep, tq, -1)
    logits[..., context] = logits[..., context] / temperature + math.log(scale)
    logits = logits.masked_fill(~visible_keys(q_pos, k_pos, window), float("-inf"))
    weights = torch.softmax(logits, dim=-1).reshape(kvh, rep * tq, -1)
    out = torch.matmul(weights.to(v.dtype), v).reshape(nh, tq, d)
    return out.transpose(0, 1).reshape(tq, nh * d)
