"""SnapKV: blocks chosen once, at prefill, by the attention of the prompt's last tokens (per layer).

The observation window (the last ``window`` prompt tokens, captured during prefill)
attends to the prompt; each block's mass (pooled over the window's queries and the
heads) ranks it for the whole generation — a static snapshot. Blocks written during
decode score 0 (they sit in the local window while the answer is short).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView
from semkv.sparse.oracle import block_attention_mass


@dataclass
class SnapKVPolicy(SparsePolicy):
    name = "snapkv"
    needs_prefill_queries = True
    _mass: list[Tensor] = field(default_factory=list, repr=False)

    @property
    def per_layer(self) -> bool:
        return True

    def prepare(self, view: StepView) -> None:
        if view.prefill is None or not view.prefill.q:
            raise ValueError("snapkv needs the prompt's queries captured at prefill")
        nb = view.index.num_complete
        rows = view.prefill.last_position() + 1
        self._mass = [
            block_attention_mass(
                view.prefill.window_queries(layer),
                view.cache.keys(layer)[:, :rows],
                view.index.block_size,
                nb,
            )
            for layer in range(view.cache.num_layers)
        ]

    def score(self, view: StepView) -> Tensor:
        assert view.layer is not None
        mass = self._mass[view.layer]
        out = torch.zeros(view.candidates.numel(), device=mass.device)
        known = view.candidates < mass.numel()
        out[known] = mass[view.candidates[known]]
        return out
