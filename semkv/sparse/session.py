"""What the engine calls: a sparse decoder per request."""

from __future__ import annotations

from typing import Any

from semkv.sparse.base import SparsePolicy
from semkv.sparse.decoder import SparseConfig, SparseDecoder
from semkv.sparse.registry import make_policy


def decoder_for(
    policy: str | SparsePolicy | None, kv_budget: float | int, block_size: int, **config: Any
) -> SparseDecoder | None:
    """A decoder for a request, or None for dense decoding (``None`` / ``"dense"``)."""
    if policy is None or policy == "dense":
        return None
    chosen = make_policy(policy) if isinstance(policy, str) else policy
    return SparseDecoder(chosen, SparseConfig(kv_budget=kv_budget, **config), block_size)
