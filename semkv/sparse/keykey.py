"""Key-Key affinity (the seed; CHESS): block relevance from keys alone, no query.

Per block, a summary vector ``v_b``: the mean pre-RoPE key of its tokens, pooled
over KV heads (weighted by each head's key variance, or plainly) and over layers
(or kept per layer). Per step, the anchor ``v_a``: the same pooling of the mean
key of the last ``anchor_tokens`` tokens. Affinity ``(cos(v_a, v_b) + 1) / 2``.

The Grid -> Chunk -> Page hierarchy: pages are the candidate blocks, a chunk is
``pages_per_chunk`` consecutive pages, a grid ``chunks_per_grid`` consecutive chunks.
One matrix product scores every grid, chunk and page against the anchor; a grid
outside the kept grids masks its chunks, a chunk outside the kept chunks masks its
pages (:func:`hierarchical_scores`). Keep fractions follow the seed's ratios
``(grid, chunk, page) = (0.5, 0.2, 0.1)`` scaled so the page level keeps the budget.

The stability filter (window 20 steps, threshold 0.5) scores each block by the
share of recent steps its affinity exceeded the threshold; blocks at or above
``keep_at`` stay resident in the fast tier when unselected, so one-step flicker
does not cause reloads (:class:`StabilityFilter`).

``page_scorer="quest"`` is the hybrid DESIGN.md anticipates for sub-1B models: the
Key-Key hierarchy picks grids and chunks (and drives residency), Quest's
query-aware bound ranks the pages inside the kept chunks, per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView
from semkv.sparse.quest import quest_scores

HEAD_POOLS = ("variance", "mean")
PAGE_SCORERS = ("keykey", "quest")


@dataclass
class StabilityFilter:
    """Share of the last ``window`` steps in which a block's affinity exceeded ``threshold``.

    ``keep_at``: stability at or above which an unselected block stays resident.
    """

    window: int = 20
    threshold: float = 0.5
    keep_at: float = 0.5
    _history: Tensor | None = field(default=None, repr=False)
    _steps: int = field(default=0, repr=False)
    _scores: Tensor | None = field(default=None, repr=False)  # of the history as it stands

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"stability window must be >= 1, got {self.window}")
        if not 0.0 <= self.threshold <= 1.0 or not 0.0 <= self.keep_at <= 1.0:
            raise ValueError("stability threshold and keep_at must be in [0, 1]")

    def update(self, affinity: Tensor) -> Tensor:
        """Record one step's affinity [nb] (blocks may only be added); return stability [nb] in [0, 1]."""
        high = (affinity > self.threshold).float()
        nb = high.numel()
        if self._history is None:
            self._history = torch.zeros(self.window, nb, device=affinity.device)
        elif self._history.shape[1] < nb:
            grown = torch.zeros(self.window, nb, device=affinity.device)
            grown[:, : self._history.shape[1]] = self._history
            self._history = grown
        self._history[self._steps % self.window, :nb] = high
        self._history[self._steps % self.window, nb:] = 0.0
        self._steps += 1
        self._scores = None
        return self.scores()[:nb]

    def scores(self) -> Tensor:
        """Stability [blocks seen] (computed once per update)."""
        if self._history is None:  # no step seen: no block, and no device to follow yet
            return torch.zeros(0, device="cpu")
        if self._scores is None:
            self._scores = self._history.sum(0) / min(self._steps, self.window)
        return self._scores

    def keep(self) -> Tensor:
        """Bool [nb]: blocks stable enough to stay resident."""
        return self.scores() >= self.keep_at


def level_sizes(num_pages: int, pages_per_chunk: int, chunks_per_grid: int) -> tuple[int, int]:
    chunks = math.ceil(num_pages / pages_per_chunk)
    return chunks, math.ceil(chunks / chunks_per_grid)


def group_mean(vectors: Tensor, group: int) -> Tensor:
    """Mean of consecutive groups of ``group`` rows of ``vectors`` [..., n, d] (last group may be short)."""
    n = vectors.shape[-2]
    ids = torch.arange(n, device=vectors.device) // group
    count = int(ids[-1]) + 1 if n else 0
    sums = torch.zeros(
        *vectors.shape[:-2], count, vectors.shape[-1], dtype=vectors.dtype, device=vectors.device
    )
    sums.index_add_(vectors.dim() - 2, ids, vectors)
    sizes = torch.bincount(ids, minlength=count).clamp(min=1).to(vectors.dtype)
    return sums / sizes.unsqueeze(-1)


def level_summaries(pages: Tensor, pages_per_chunk: int, chunks_per_grid: int) -> Tensor:
    """Unit-norm grid, chunk and page summaries stacked ``[..., G + C + P, d]`` (grids first).

    pages: [..., P, d]. A chunk is the mean of its pages, a grid the mean of its chunks. Built
    once per new block (summaries never change), so a step costs one matrix product.
    """
    chunks = group_mean(pages, pages_per_chunk)
    grids = group_mean(chunks, chunks_per_grid)
    return F.normalize(torch.cat([grids, chunks, pages], dim=-2), dim=-1)


def masked_page_scores(
    affinity: Tensor,
    num_pages: int,
    pages_per_chunk: int,
    chunks_per_grid: int,
    keep_grids: int,
    keep_chunks: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Split stacked affinities [..., G + C + P] into levels and mask children of unkept parents.

    Returns (page affinity [..., P] with -inf on masked pages, chunk kept [..., C], grid kept [..., G]).
    """
    num_c, num_g = level_sizes(num_pages, pages_per_chunk, chunks_per_grid)
    grid_aff, chunk_aff, page_aff = affinity.split([num_g, num_c, num_pages], dim=-1)
    grid_keep = _top_mask(grid_aff, keep_grids)
    chunk_parent = torch.arange(num_c, device=affinity.device) // chunks_per_grid
    chunk_aff = chunk_aff.masked_fill(~grid_keep[..., chunk_parent], -math.inf)
    chunk_keep = _top_mask(chunk_aff, keep_chunks)
    page_parent = torch.arange(num_pages, device=affinity.device) // pages_per_chunk
    page_aff = page_aff.masked_fill(~chunk_keep[..., page_parent], -math.inf)
    return page_aff, chunk_keep, grid_keep


def affinity(stacked: Tensor, anchor: Tensor) -> Tensor:
    """``(cos + 1) / 2`` of unit-norm summaries [..., n, d] against an anchor [..., d] -> [..., n]."""
    return (stacked @ F.normalize(anchor, dim=-1).unsqueeze(-1)).squeeze(-1).add(1.0).mul(0.5)


def hierarchical_scores(
    pages: Tensor,
    anchor: Tensor,
    pages_per_chunk: int,
    chunks_per_grid: int,
    keep_grids: int,
    keep_chunks: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Score grids, chunks and pages with ONE matrix product; mask children of unkept parents.

    pages: [..., P, d] page summaries (a leading dim = independent problems, e.g. layers);
    anchor: [..., d]. Returns (page affinity [..., P] with -inf on masked pages,
    chunk kept mask [..., C], grid kept mask [..., G]). Affinity = (cos + 1) / 2.
    """
    stacked = level_summaries(pages, pages_per_chunk, chunks_per_grid)
    return masked_page_scores(
        affinity(stacked, anchor), pages.shape[-2], pages_per_chunk, chunks_per_grid, keep_grids, keep_chunks
    )


def _top_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask of the ``k`` highest finite entries along the last dim."""
    n = scores.shape[-1]
    if k >= n:
        return torch.isfinite(scores)
    idx = torch.topk(scores, k, dim=-1).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, idx, True)
    return mask & torch.isfinite(scores)


@dataclass
class KeyKeyPolicy(SparsePolicy):
    """Key-Key affinity with the Grid -> Chunk -> Page hierarchy and the stability filter.

    head_pool: "variance" (weight KV heads by key variance) or "mean".
    layerwise: one summary per layer (selection per layer) instead of one pooled over layers.
    anchor_tokens: how many of the latest tokens' keys form the anchor.
    hierarchy: (grid, chunk, page) keep ratios; the page ratio is replaced by the budget and
        the grid/chunk ratios scaled by the same factor (at budget 0.1 they are the seed's).
    center: subtract the mean page summary from summaries and anchor before the cosine
        (keys share a large common direction; without it every cosine is near 1).
    stability: the residency filter, or None (resident = selected).
    page_scorer: "keykey" or "quest" (hybrid: Key-Key grids/chunks, Quest pages, per layer).
    """

    name = "keykey"
    head_pool: str = "variance"
    layerwise: bool = False
    anchor_tokens: int = 8
    hierarchy: tuple[float, float, float] = (0.5, 0.2, 0.1)
    pages_per_chunk: int = 4
    chunks_per_grid: int = 4
    center: bool = True
    stability: StabilityFilter | None = field(default_factory=StabilityFilter)
    page_scorer: str = "keykey"
    _step_cache: tuple[int, Tensor, Tensor] | None = field(default=None, repr=False)
    _weights: Tensor | None = field(default=None, repr=False)
    _pooled: Tensor | None = field(default=None, repr=False)
    _levels: tuple[tuple[int, int, int], Tensor, Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.head_pool not in HEAD_POOLS:
            raise ValueError(f"head_pool must be one of {HEAD_POOLS}, got {self.head_pool!r}")
        if self.page_scorer not in PAGE_SCORERS:
            raise ValueError(f"page_scorer must be one of {PAGE_SCORERS}, got {self.page_scorer!r}")
        if self.anchor_tokens < 1 or self.pages_per_chunk < 1 or self.chunks_per_grid < 1:
            raise ValueError("anchor_tokens, pages_per_chunk and chunks_per_grid must be >= 1")
        g, c, p = self.hierarchy
        if not (0.0 < p <= c <= g <= 1.0):
            raise ValueError(
                f"hierarchy ratios must satisfy 0 < page <= chunk <= grid <= 1, got {self.hierarchy}"
            )

    @property
    def per_layer(self) -> bool:
        return self.layerwise or self.page_scorer == "quest"

    def describe(self) -> dict:
        out = super().describe()
        out["stability"] = self.stability is not None
        return out

    # -- summaries ------------------------------------------------------------------------------
    def prepare(self, view: StepView) -> None:
        """Summaries of the prompt's blocks, built once (a block's summary never changes)."""
        self._weights = None
        self._pooled = None
        self._levels = None
        self._step_cache = None
        self._pooled_pages(view)

    def _head_weights(self, view: StepView) -> Tensor:
        """[L, kvh] weights summing to 1 per layer (frozen at first use)."""
        if self._weights is None:
            variance = view.index.head_variance()
            weights = variance if self.head_pool == "variance" else torch.ones_like(variance)
            self._weights = weights / weights.sum(dim=1, keepdim=True)
        return self._weights

    def _pool(self, per_head: Tensor, weights: Tensor) -> Tensor:
        """per_head [L, kvh, n, d] -> [L, n, d] (layerwise) or [n, d] (pooled over layers too)."""
        pooled = (per_head * weights[:, :, None, None]).sum(dim=1)
        return pooled if self.layerwise else pooled.mean(dim=0)

    def _pooled_pages(self, view: StepView) -> Tensor:
        """[.., nb, d] pooled summaries of every complete block, extended as blocks complete."""
        means = view.index.key_means()  # [L, kvh, nb, d]
        have = 0 if self._pooled is None else self._pooled.shape[-2]
        if have < means.shape[2]:
            new = self._pool(means[:, :, have:], self._head_weights(view))
            self._pooled = new if self._pooled is None else torch.cat([self._pooled, new], dim=-2)
        assert self._pooled is not None
        return self._pooled

    def _anchor_means(self, view: StepView) -> Tensor:
        """[L, kvh, 1, d] mean pre-RoPE key of the last ``anchor_tokens`` fully written rows."""
        cache = view.cache
        end = cache.length - 1  # the current row is not yet written at every layer
        start = max(0, end - self.anchor_tokens)
        if end <= start:
            end, start = cache.length, max(0, cache.length - 1)
        return torch.stack([k[:, start:end] for k in cache.k_pre]).float().mean(dim=2, keepdim=True)

    def _anchor(self, view: StepView) -> Tensor:
        """[.., d] pooled anchor (not normalised)."""
        return self._pool(self._anchor_means(view), self._head_weights(view)).squeeze(-2)

    def _level_summaries(self, view: StepView) -> tuple[Tensor, Tensor]:
        """(unit-norm stacked grid/chunk/page summaries [.., G + C + P, d], centre [.., d]), rebuilt
        only when the candidate span or the number of summarised blocks changes."""
        span = view.candidate_span()
        key = (span.start, span.stop, view.index.num_complete)
        if self._levels is None or self._levels[0] != key:
            pooled = self._pooled_pages(view)
            centre = pooled.mean(dim=-2) if self.center else torch.zeros_like(pooled[..., 0, :])
            pages = pooled[..., span, :] - centre.unsqueeze(-2)
            self._levels = (key, level_summaries(pages, self.pages_per_chunk, self.chunks_per_grid), centre)
        return self._levels[1], self._levels[2]

    def _keep_counts(self, view: StepView, num_pages: int) -> tuple[int, int]:
        chunks, grids = level_sizes(num_pages, self.pages_per_chunk, self.chunks_per_grid)
        page_frac = min(1.0, view.budget / max(1, num_pages))
        g, c, p = self.hierarchy
        keep_c = max(
            math.ceil(min(1.0, page_frac * c / p) * chunks), math.ceil(view.budget / self.pages_per_chunk)
        )
        keep_g = max(math.ceil(min(1.0, page_frac * g / p) * grids), math.ceil(keep_c / self.chunks_per_grid))
        return min(grids, keep_g), min(chunks, keep_c)

    def _hierarchy(self, view: StepView) -> tuple[Tensor, Tensor]:
        """(page affinity [.., P] masked by the hierarchy, raw page affinity [.., P]) — once per step."""
        if self._step_cache is not None and self._step_cache[0] == view.step:
            return self._step_cache[1], self._step_cache[2]
        stacked, centre = self._level_summaries(view)
        num_pages = view.candidates.numel()
        scores = affinity(stacked, self._anchor(view) - centre)
        keep_g, keep_c = self._keep_counts(view, num_pages)
        masked, _, _ = masked_page_scores(
            scores, num_pages, self.pages_per_chunk, self.chunks_per_grid, keep_g, keep_c
        )
        raw = scores[..., -num_pages:]
        if self.stability is not None:
            flat = raw if raw.dim() == 1 else raw.mean(dim=0)
            full = torch.zeros(view.index.num_complete, device=flat.device)
            full[view.candidate_span()] = flat
            self.stability.update(full)
        self._step_cache = (view.step, masked, raw)
        return masked, raw

    def score(self, view: StepView) -> Tensor:
        masked, _ = self._hierarchy(view)
        if self.layerwise:
            assert view.layer is not None
            masked = masked[view.layer]
        if self.page_scorer == "keykey":
            return masked
        assert view.layer is not None and view.q_rot is not None
        bound = quest_scores(view, aggregate="mass")
        return bound.masked_fill(~torch.isfinite(masked), -math.inf)

    def resident_hint(self) -> Tensor | None:
        if self.stability is None:
            return None
        return self.stability.scores().masked_fill(~self.stability.keep(), -1.0)


@dataclass
class HybridPolicy(KeyKeyPolicy):
    """Key-Key grids/chunks and residency, Quest's query-aware bound for the final pages (per layer)."""

    name = "hybrid"
    page_scorer: str = "quest"
