"""Sparse decode: each decode step attends only to the most relevant KV blocks.

One policy per module behind :class:`SparsePolicy` (one method, ``score``), one
registry (:data:`POLICIES`); :class:`SparseDecoder` applies any of them with the
same budget, sink, window and two-tier residency. ``Engine.generate(sparse=...,
kv_budget=...)`` builds one per request with :func:`semkv.sparse.session.decoder_for`.
"""

from __future__ import annotations

from semkv.sparse.base import Budget, SparsePolicy, StepView
from semkv.sparse.decoder import SparseConfig, SparseDecoder
from semkv.sparse.index import BlockIndex, PrefillQueries, capture_prefill_queries
from semkv.sparse.keykey import HybridPolicy, KeyKeyPolicy, StabilityFilter, hierarchical_scores
from semkv.sparse.oracle import block_attention_mass
from semkv.sparse.probe import ProbePolicy
from semkv.sparse.registry import POLICIES, make_policy, validate_sparse

__all__ = [
    "POLICIES",
    "BlockIndex",
    "HybridPolicy",
    "KeyKeyPolicy",
    "Budget",
    "PrefillQueries",
    "ProbePolicy",
    "SparseConfig",
    "SparseDecoder",
    "SparsePolicy",
    "StabilityFilter",
    "StepView",
    "block_attention_mass",
    "capture_prefill_queries",
    "hierarchical_scores",
    "make_policy",
    "validate_sparse",
]
