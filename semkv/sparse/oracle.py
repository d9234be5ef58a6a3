"""The oracle: the true attention mass of each block, per layer (measurement only).

DESIGN.md: the query that matters is the one of the step being decoded (the prompt's
last query ranks a passkey block far down), so the oracle is defined per decode
step and per layer, never from the prompt's end. It reads every key, so it is
slower than dense decode: it is an upper reference for selection quality, not a method.

Two measurement variants locate where a cheaper policy loses: ``query="previous"`` ranks by the
true attention of the previous step's query (the prompt's last token's at the first step), and
``shared=True`` (with previous queries) makes one choice per step for every layer, by the mass
averaged over layers — what a policy that selects once per step, before layer 0, could know at best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView

QUERIES = ("current", "previous")


def block_attention_mass(q_rot: Tensor, keys: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """Attention mass per block [num_blocks], averaged over query heads.

    q_rot: [nh, n, d] (n queries: masses are averaged over them too); keys: [kvh, T, d] rows
    0..T-1 in block order, T >= num_blocks * block_size (rows past the blocks count in the
    softmax but not in the result). All keys are assumed visible to the queries. Computed in float32.
    """
    q_rot, keys = q_rot.float(), keys.float()
    kvh, d = keys.shape[0], keys.shape[-1]
    group = q_rot.shape[0] // kvh
    q = q_rot.reshape(kvh, group * q_rot.shape[1], d)
    probs = torch.softmax(q @ keys.transpose(1, 2) / math.sqrt(d), dim=-1)  # [kvh, g*n, T]
    mass = probs[..., : num_blocks * block_size].reshape(kvh, -1, num_blocks, block_size).sum(-1)
    return mass.mean(dim=(0, 1))


@dataclass
class OraclePolicy(SparsePolicy):
    """Top blocks by the true attention mass at each layer (of this step's query by default)."""

    name = "oracle"
    query: str = "current"
    shared: bool = False
    _previous: dict[int, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.query not in QUERIES:
            raise ValueError(f"query must be one of {QUERIES}, got {self.query!r}")
        if self.shared and self.query != "previous":
            raise ValueError("shared=True needs query='previous' (one choice before layer 0 attends)")

    @property
    def needs_prefill_queries(self) -> bool:  # type: ignore[override]
        return self.query == "previous"

    @property
    def per_layer(self) -> bool:
        return not self.shared

    def prepare(self, view: StepView) -> None:
        if self.query == "previous":
            if view.prefill is None or not view.prefill.q:
                raise ValueError(
                    "oracle with query='previous' needs the prompt's queries captured at prefill"
                )
            self._previous = {layer: view.prefill.q[layer][:, -1:] for layer in view.selecting}

    def see_query(self, layer: int, q_rot: Tensor) -> None:
        if self.query == "previous":
            self._previous[layer] = q_rot

    def _mass(self, view: StepView, layer: int, q_rot: Tensor) -> Tensor:
        keys = view.cache.keys(layer)
        mass = block_attention_mass(q_rot, keys, view.index.block_size, view.index.num_complete)
        return mass[view.candidates]

    def score(self, view: StepView) -> Tensor:
        if self.shared:
            layers = view.selecting or tuple(sorted(self._previous))
            return torch.stack([self._mass(view, layer, self._previous[layer]) for layer in layers]).mean(0)
        assert view.layer is not None and view.q_rot is not None
        q = self._previous[view.layer] if self.query == "previous" else view.q_rot
        return self._mass(view, view.layer, q)
