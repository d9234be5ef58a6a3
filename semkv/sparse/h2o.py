"""H2O: heavy hitters by accumulated attention, at block granularity, per layer.

Accumulation starts at prefill from the attention of the captured prompt queries
(every ``stride``-th prompt token plus the last ones: the full prompt's attention
matrix is too costly to form on this CPU) and continues every decode step with the
attention the step's query gives the blocks it attended to — which is the method's
cost: it must compute and keep attention scores that fused kernels never expose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView


@dataclass
class H2OPolicy(SparsePolicy):
    name = "h2o"
    needs_prefill_queries = True
    _acc: list[Tensor] = field(default_factory=list, repr=False)

    @property
    def per_layer(self) -> bool:
        return True

    def prepare(self, view: StepView) -> None:
        if view.prefill is None or not view.prefill.q:
            raise ValueError("h2o needs the prompt's queries captured at prefill")
        nb = view.index.num_complete
        bs = view.index.block_size
        self._acc = []
        for layer in range(view.cache.num_layers):
            keys = view.cache.keys(layer)[:, : nb * bs].float()  # [kvh, T, d]
            kvh, d = keys.shape[0], keys.shape[-1]
            q = view.prefill.q[layer]  # [nh, n, d]
            positions = view.prefill.positions[layer]  # [n]
            q = q.reshape(kvh, -1, q.shape[1], d)  # [kvh, g, n, d]
            logits = q @ keys.transpose(1, 2).unsqueeze(1) / math.sqrt(d)  # [kvh, g, n, T]
            visible = torch.arange(keys.shape[1], device=keys.device).unsqueeze(0) <= positions.unsqueeze(
                1
            )  # [n, T]
            probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
            mass = probs.sum(dim=2).mean(dim=(0, 1))  # [T] summed over queries, mean over heads
            self._acc.append(mass.reshape(nb, bs).sum(-1))

    def score(self, view: StepView) -> Tensor:
        assert view.layer is not None
        acc = self._acc[view.layer]
        out = torch.zeros(view.candidates.numel(), device=acc.device)
        known = view.candidates < acc.numel()
        out[known] = acc[view.candidates[known]]
        return out

    def observe(self, view: StepView, selected: Tensor, keys: Tensor, k_pos: Tensor) -> None:
        """Add the step's attention over the attended rows to their blocks (``k_pos`` = cache rows)."""
        assert view.layer is not None and view.q_rot is not None
        kvh, d = keys.shape[0], keys.shape[-1]
        q = view.q_rot.reshape(kvh, -1, d)
        probs = torch.softmax(q @ keys.transpose(1, 2) / math.sqrt(d), dim=-1).mean(dim=(0, 1))  # [R]
        blocks = k_pos // view.index.block_size
        acc = self._acc[view.layer]
        inside = blocks < acc.numel()
        acc.index_add_(0, blocks[inside], probs[inside])
