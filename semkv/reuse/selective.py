"""Selective recompute by KV deviation: the mechanism CacheBlend and SemShareKV share.

Both paths pre-load reused KV into the cache rows (re-rotated to the new positions)
and run :meth:`Runtime.forward_rows` with a :class:`DeviationSelector`. At every
layer listed in ``schedule`` the selector compares each still-active reusable row's
fresh KV with its reused KV and keeps the rows that deviate most; ``forced`` rows
(uncached tokens: question, template, separators, unmatched tokens) are always kept.
Layers before the first scheduled layer recompute every row (layer 0 always does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

DeviationOn = Literal["k", "v", "kv"]


def kv_deviation(
    fresh_k: Tensor, fresh_v: Tensor, cached_k: Tensor, cached_v: Tensor, on: DeviationOn
) -> Tensor:
    """Per-row L2 deviation [A] between fresh and reused KV (each [kvh, A, d])."""
    parts = []
    if on in ("k", "kv"):
        parts.append((fresh_k - cached_k).pow(2).sum(dim=(0, 2)))
    if on in ("v", "kv"):
        parts.append((fresh_v - cached_v).pow(2).sum(dim=(0, 2)))
    return torch.stack(parts).sum(0).sqrt()


@dataclass
class DeviationSelector:
    """Keep forced rows plus the top fraction of reusable rows by deviation.

    forced: bool [T] over the rows being computed: True = always recompute.
    schedule: layer -> fraction of *all reusable rows* kept from that layer on. Layers
        not listed keep every active row. Fractions should not grow with depth.
    deviation_on: compare keys, values or both.
    chosen: filled in: layer -> row offsets kept there (for stats and highlighting).
    """

    forced: Tensor
    schedule: dict[int, float]
    deviation_on: DeviationOn = "v"
    chosen: dict[int, Tensor] = field(default_factory=dict)
    deviations: dict[int, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.deviation_on not in ("k", "v", "kv"):
            raise ValueError(f"deviation_on must be 'k', 'v' or 'kv', got {self.deviation_on!r}")
        for layer, ratio in self.schedule.items():
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"recompute ratio {ratio} at layer {layer} outside [0, 1]")
        self.forced = self.forced.bool()
        self.num_reusable = int((~self.forced).sum())

    def select(
        self, layer: int, active: Tensor, fresh_k: Tensor, fresh_v: Tensor, cached_k: Tensor, cached_v: Tensor
    ) -> Tensor:
        if layer not in self.schedule:
            return torch.arange(active.numel(), device=active.device)
        forced = self.forced[active]
        budget = min(math.ceil(self.schedule[layer] * self.num_reusable), int((~forced).sum()))
        deviation = kv_deviation(fresh_k, fresh_v, cached_k, cached_v, self.deviation_on)
        self.deviations[layer] = deviation
        candidates = (~forced).nonzero().squeeze(1)
        top = candidates[torch.topk(deviation[candidates], budget).indices] if budget > 0 else candidates[:0]
        keep = torch.cat([forced.nonzero().squeeze(1), top]).sort().values
        self.chosen[layer] = active[keep]
        return keep

    def recomputed_rows(self) -> Tensor:
        """Row offsets recomputed through the deepest scheduled layer (forced rows included)."""
        if not self.chosen:
            return torch.arange(self.forced.numel())
        return self.chosen[max(self.chosen)]
