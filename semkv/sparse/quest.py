"""Quest: a query-aware upper bound of each block's attention from per-channel key min/max.

For a query ``q`` and a block whose rotated keys have per-channel minimum ``m`` and
maximum ``M``, ``sum_d max(q_d * m_d, q_d * M_d)`` bounds ``q . k`` for every key of
the block. Quest ranks blocks by this bound, per layer. Blocks are shared by the
query heads of a KV head group, so the per-head bounds are combined:
``aggregate="max"`` takes the largest bound over heads; ``"mass"`` turns each head's
bounds into an estimated attention distribution over blocks (softmax of the scaled
bound) and averages heads (DESIGN.md: this ranked blocks better on SmolLM2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView

AGGREGATES = ("mass", "max")


def quest_scores(view: StepView, aggregate: str = "mass") -> Tensor:
    """Scores [C] of ``view.candidates`` at ``view.layer`` for ``view.q_rot`` [nh, 1, d].

    ``sum_d max(q_d m_d, q_d M_d) = q+ . M + q- . m`` (q+ / q- the positive / negative parts of q),
    so the bound of every block is two matrix products.
    """
    assert view.layer is not None and view.q_rot is not None
    mins, maxs = view.index.key_bounds()
    span = view.candidate_span()
    kmin, kmax = mins[view.layer][:, span], maxs[view.layer][:, span]  # [kvh, C, d]
    kvh, d = kmin.shape[0], kmin.shape[-1]
    q = view.q_rot[:, 0].reshape(kvh, -1, d)  # [kvh, g, d]
    bound = q.clamp(min=0) @ kmax.transpose(1, 2) + q.clamp(max=0) @ kmin.transpose(1, 2)  # [kvh, g, C]
    bound = bound.reshape(-1, bound.shape[-1])  # [nh, C]
    if aggregate == "max":
        return bound.amax(dim=0)
    return torch.softmax(bound / math.sqrt(d), dim=-1).mean(dim=0)


@dataclass
class QuestPolicy(SparsePolicy):
    """Quest's per-block per-channel key min/max bound, per layer."""

    name = "quest"
    aggregate: str = "mass"

    def __post_init__(self) -> None:
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")

    @property
    def per_layer(self) -> bool:
        return True

    def prepare(self, view: StepView) -> None:
        view.index.key_bounds()  # summaries of the prompt's blocks, built once

    def score(self, view: StepView) -> Tensor:
        return quest_scores(view, self.aggregate)
