"""The interface every prefill path implements, and the registry the engine reads.

A path answers two questions for a request: ``plan`` — can I serve it, and how
many prompt tokens would I reuse (or why not)? — and ``prefill`` — fill the live
cache and return the last prompt token's logits. After the first token,
``after_prefill`` may store what the prefill made reusable (chunks, the prompt
for sharing). ``reuse="auto"`` asks every path for a plan and runs the one that
reuses most (:class:`semkv.engine.Engine.plan`); the paths of an engine are built
by :func:`semkv.reuse.registry.build_paths`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.runtime import Runtime
from semkv.prompt import PromptLayout
from semkv.reuse.options import ReuseOptions
from semkv.store.store import KVStore


@dataclass
class PrefillContext:
    """What a path may use: the runtime, the store and the model's identity."""

    runtime: Runtime
    store: KVStore
    fingerprint: str
    block_size: int
    tokenizer: Any


@dataclass
class Plan:
    """A path's offer for one request; subclasses carry what the path needs."""

    path: str
    layout: PromptLayout
    reused_tokens: int


@dataclass
class Refusal:
    path: str
    reason: str


@dataclass
class PrefillOutcome:
    """logits: [V] of the last prompt token. exact: the cache now equals a full prefill's
    (so its rows may be stored as exact prefix blocks)."""

    logits: Tensor
    path: str
    reused_tokens: int
    recomputed_tokens: int
    exact: bool
    info: dict[str, Any] = field(default_factory=dict)


class ReusePath(Protocol):
    """One prefill path (full, prefix, blend, share)."""

    name: str

    def plan(self, ctx: PrefillContext, options: ReuseOptions, layout: PromptLayout) -> Plan | Refusal:
        """An offer for this request, or the reason this path cannot serve it."""
        ...

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome:
        """Fill ``cache`` (empty) with the prompt's KV as planned; the last prompt token's logits."""
        ...

    def after_prefill(
        self,
        ctx: PrefillContext,
        options: ReuseOptions,
        layout: PromptLayout,
        cache: KVCache,
        outcome: PrefillOutcome,
    ) -> None:
        """Called after every request's first token, whichever path served it (store what is reusable)."""
        ...
