"""The interface every prefill path implements, and the registry the engine reads.

A path answers two questions for a request: ``plan`` — can I serve it, and how
many prompt tokens would I reuse (or why not)? — and ``prefill`` — fill the live
cache and return the last prompt token's logits. ``reuse="auto"`` asks every
registered path for a plan and runs the one that reuses most.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.runtime import Runtime
from semkv.prompt import PromptLayout
from semkv.request import GenerateRequest
from semkv.store.store import KVStore


@dataclass
class PrefillContext:
    """What a path may use: the runtime, the store and the model's identity."""

    runtime: Runtime
    store: KVStore
    fingerprint: str
    block_size: int
    tokenizer: Any
    settings: dict[str, Any] = field(default_factory=dict)  # engine-wide defaults (e.g. calibrated profile)


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
    name: str

    def plan(self, ctx: PrefillContext, request: GenerateRequest, layout: PromptLayout) -> Plan | Refusal: ...

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome: ...


REUSE_PATHS: dict[str, ReusePath] = {}
# Called after every prefill with (ctx, request, layout, cache, outcome): e.g. remember the prompt for sharing.
POST_PREFILL_HOOKS: list[Callable[..., None]] = []


def register_path(path: ReusePath) -> ReusePath:
    REUSE_PATHS[path.name] = path
    return path
