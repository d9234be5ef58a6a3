"""The oracle: the true attention mass of each block for this step's query, per layer (measurement only).

DESIGN.md: the query that matters is the one of the step being decoded (the prompt's
last query ranks a passkey block far down), so the oracle is defined per decode
step and per layer, never from the prompt's end. It reads every key, so it is
slower than dense decode: it is an upper reference for selection quality, not a method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView


def block_attention_mass(q_rot: Tensor, keys: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """Attention mass per block [num_blocks], averaged over query heads.

    q_rot: [nh, n, d] (n queries: masses are averaged over them too); keys: [kvh, T, d] rows
    0..T-1 in block order, T >= num_blocks * block_size (rows past the blocks count in the
    softmax but not in the result). All keys are assumed visible to the queries.
    """
    kvh, d = keys.shape[0], keys.shape[-1]
    group = q_rot.shape[0] // kvh
    q = q_rot.reshape(kvh, group * q_rot.shape[1], d)
    probs = torch.softmax(q @ keys.transpose(1, 2) / math.sqrt(d), dim=-1)  # [kvh, g*n, T]
    mass = probs[..., : num_blocks * block_size].reshape(kvh, -1, num_blocks, block_size).sum(-1)
    return mass.mean(dim=(0, 1))


@dataclass
class OraclePolicy(SparsePolicy):
    """Top blocks by this step's true attention mass at each layer."""

    name = "oracle"

    @property
    def per_layer(self) -> bool:
        return True

    def score(self, view: StepView) -> Tensor:
        assert view.layer is not None and view.q_rot is not None
        keys = view.cache.keys(view.layer)
        mass = block_attention_mass(view.q_rot, keys, view.index.block_size, view.index.num_complete)
        return mass[view.candidates]
