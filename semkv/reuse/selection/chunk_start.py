"""``chunk-start``: EPIC / LegoLink (arXiv 2410.15332): recompute the first ``k`` tokens of every chunk.

A chunk computed on its own turns its first tokens into an attention sink; in the blended prompt those
rows are wrong in a way later tokens are not. The score is minus the offset inside the chunk, so a
budget smaller than ``k`` x chunks takes the same number of first tokens from every chunk; rows past
``k`` are never taken (the budget may stay unspent). Selection costs O(kN), no attention or deviation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from semkv.reuse.selection.base import RowSelector, ScoreView


@dataclass(frozen=True)
class ChunkStartSelector(RowSelector):
    """k: tokens recomputed at the start of every chunk (>= 0)."""

    name: ClassVar[str] = "chunk-start"

    k: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"k must be an int >= 0 (tokens recomputed per chunk start), got {self.k!r}")

    def score(self, view: ScoreView) -> Tensor:
        offset = view.rows.chunk_offset[view.candidate_rows]
        score = -offset.to(torch.float32)
        return score.masked_fill((offset < 0) | (offset >= self.k), float("-inf"))
