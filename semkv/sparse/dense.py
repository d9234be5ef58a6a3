"""Dense decode: every block, every step (the reference every policy is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView


@dataclass
class DensePolicy(SparsePolicy):
    name = "dense"

    @property
    def is_dense(self) -> bool:
        return True

    def score(self, view: StepView) -> Tensor:
        return view.candidates.float().new_ones(view.candidates.numel())
