"""StreamingLLM: the attention sink plus the most recent blocks (the window grows to the budget)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView


@dataclass
class StreamingPolicy(SparsePolicy):
    """Sink + window: at equal budget the budget's blocks are the latest ones."""

    name = "streaming"

    def score(self, view: StepView) -> Tensor:
        return view.candidates.float()
