"""The sparse decode policies by name. A new policy is one module plus one line here."""

from __future__ import annotations

import dataclasses
from typing import Any

from semkv.sparse.base import Budget, SparsePolicy
from semkv.sparse.dense import DensePolicy
from semkv.sparse.h2o import H2OPolicy
from semkv.sparse.keykey import HybridPolicy, KeyKeyPolicy
from semkv.sparse.oracle import OraclePolicy
from semkv.sparse.probe import ProbePolicy
from semkv.sparse.quest import QuestPolicy
from semkv.sparse.snapkv import SnapKVPolicy
from semkv.sparse.streaming import StreamingPolicy
from semkv.validation import check_int

POLICIES: dict[str, type[SparsePolicy]] = {
    cls.name: cls
    for cls in (
        DensePolicy,
        KeyKeyPolicy,
        HybridPolicy,
        ProbePolicy,
        OraclePolicy,
        QuestPolicy,
        StreamingPolicy,
        H2OPolicy,
        SnapKVPolicy,
    )
}


def make_policy(name: str, **options: Any) -> SparsePolicy:
    """A policy from the registry by name; ``options`` are its public dataclass fields (a ValueError names
    an unknown one)."""
    if name not in POLICIES:
        raise ValueError(f"unknown sparse policy {name!r}; choose one of {', '.join(POLICIES)}")
    cls = POLICIES[name]
    known = {f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} of sparse policy {name!r}; known: {sorted(known)}")
    return cls(**options)


AUTO = "auto"  # the engine picks the policy (and budget) its calibrated profile measured best


# the longest reselection period a request may ask for (a period past the answer's length chooses only
# when the window or the budget changes, which any value above the longest answers already does)
MAX_RESELECT_EVERY = 4096


def validate_sparse(policy: str | None, kv_budget: float | int, reselect_every: int | None = None) -> None:
    """Raise ValueError for an unknown policy name (``"auto"`` is valid), a bad budget, or a reselection
    period (``SparseConfig.reselect_every``; None: the decoder's default) outside [1,
    :data:`MAX_RESELECT_EVERY`]."""
    if reselect_every is not None:
        check_int("sparse_reselect_every", reselect_every, 1, MAX_RESELECT_EVERY)
    if policy is not None and policy != AUTO and policy not in POLICIES:
        raise ValueError(f"unknown sparse policy {policy!r}; choose {AUTO!r} or one of {', '.join(POLICIES)}")
    Budget(kv_budget)
