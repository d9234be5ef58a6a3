"""Sparse decode: each decode step attends only to the most relevant KV blocks.

One policy per module behind :class:`SparsePolicy` (one method, ``score``), one
registry (:data:`POLICIES`); :class:`SparseDecoder` applies any of them with the
same budget, sink, window and two-tier residency. ``Engine.generate(sparse=...,
kv_budget=...)`` builds one per request with :func:`build_decoder`.
"""

from __future__ import annotations

from typing import Any

from semkv.sparse.base import Budget, SparsePolicy, StepView
from semkv.sparse.decoder import SparseConfig, SparseDecoder
from semkv.sparse.dense import DensePolicy
from semkv.sparse.h2o import H2OPolicy
from semkv.sparse.index import BlockIndex, PrefillQueries, capture_prefill_queries
from semkv.sparse.keykey import HybridPolicy, KeyKeyPolicy, StabilityFilter, hierarchical_scores
from semkv.sparse.oracle import OraclePolicy, block_attention_mass
from semkv.sparse.quest import QuestPolicy
from semkv.sparse.snapkv import SnapKVPolicy
from semkv.sparse.streaming import StreamingPolicy

POLICIES: dict[str, type[SparsePolicy]] = {
    cls.name: cls
    for cls in (
        DensePolicy,
        KeyKeyPolicy,
        HybridPolicy,
        OraclePolicy,
        QuestPolicy,
        StreamingPolicy,
        H2OPolicy,
        SnapKVPolicy,
    )
}


def make_policy(name: str, **options: Any) -> SparsePolicy:
    """A policy from the registry by name; ``options`` are its dataclass fields."""
    if name not in POLICIES:
        raise ValueError(f"unknown sparse policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**options)


def build_decoder(
    policy: str | SparsePolicy,
    kv_budget: float | int,
    block_size: int,
    prefill: PrefillQueries | None = None,
    **config: Any,
) -> SparseDecoder:
    """A :class:`SparseDecoder` for one generation."""
    chosen = make_policy(policy) if isinstance(policy, str) else policy
    return SparseDecoder(chosen, SparseConfig(kv_budget=kv_budget, **config), block_size, prefill)


def validate_sparse(policy: str | None, kv_budget: float | int) -> None:
    """Raise ValueError for an unknown policy name or a bad budget."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"unknown sparse policy {policy!r}; choose one of {', '.join(POLICIES)}")
    Budget(kv_budget)


__all__ = [
    "POLICIES",
    "BlockIndex",
    "Budget",
    "PrefillQueries",
    "SparseConfig",
    "SparseDecoder",
    "SparsePolicy",
    "StabilityFilter",
    "StepView",
    "block_attention_mass",
    "build_decoder",
    "capture_prefill_queries",
    "hierarchical_scores",
    "make_policy",
    "validate_sparse",
]
