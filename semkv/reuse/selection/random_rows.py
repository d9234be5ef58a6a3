"""``random``: a seeded uniform choice of rows, the control every ranking must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from semkv.reuse.selection.base import RowSelector, ScoreView


@dataclass(frozen=True)
class RandomSelector(RowSelector):
    """seed: the choice's seed (with the layer), so a request is reproducible."""

    name: ClassVar[str] = "random"

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")

    def score(self, view: ScoreView) -> Tensor:
        # drawn on the host so a seed gives the same rows on every device
        generator = torch.Generator(device="cpu").manual_seed(self.seed * 1000 + view.layer)
        scores = torch.rand(view.candidates.numel(), generator=generator, device="cpu")
        return scores.to(view.candidates.device)
