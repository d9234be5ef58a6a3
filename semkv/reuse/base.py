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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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


class BlockSummaries(Protocol):
    """Per-block summaries of a cache's complete blocks (:class:`semkv.sparse.index.BlockIndex`)."""

    num_complete: int

    def block_summaries(self, block: int) -> dict[str, Tensor]:
        """The summaries of one complete block ({kind: tensor}), as the store keeps them."""
        ...


@dataclass
class PrefillOutcome:
    """logits: [V] of the last prompt token. exact: the cache now equals a full prefill's
    (so its rows may be stored as exact prefix blocks).

    stored_summaries: the block summaries that came with the leading blocks loaded from the store
        (block 0, 1, ... in order), so they are not recomputed.
    summaries: the summaries of the cache's complete blocks once the engine has them (after the
        prefill); ``after_prefill`` stores them with the blocks it stores.
    """

    logits: Tensor
    path: str
    reused_tokens: int
    recomputed_tokens: int
    exact: bool
    info: dict[str, Any] = field(default_factory=dict)
    stored_summaries: list[Mapping[str, Tensor]] = field(default_factory=list)
    summaries: BlockSummaries | None = None


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


@dataclass
class LoadedRows:
    """What :meth:`TailPrefillPath.load` put into a cache: its info and the summaries the loaded blocks
    carried (see :attr:`PrefillOutcome.stored_summaries`)."""

    info: dict[str, Any] = field(default_factory=dict)
    stored_summaries: list[Mapping[str, Tensor]] = field(default_factory=list)

    def outcome(self, path: str, plan: Plan, logits: Tensor, **info: Any) -> PrefillOutcome:
        """The exact outcome once the rest of the prompt is prefilled: ``logits`` [V] of its last token;
        ``info`` is added to the load's."""
        recomputed = len(plan.layout.token_ids) - plan.reused_tokens
        return PrefillOutcome(
            logits,
            path,
            plan.reused_tokens,
            recomputed,
            exact=True,
            info={**self.info, **info},
            stored_summaries=self.stored_summaries,
        )


@runtime_checkable
class TailPrefillPath(Protocol):
    """A path whose prefill is exact and has two parts: load the plan's ``reused_tokens`` leading rows
    (none for full prefill), then a plain prefill of the rest. The engine can run the rest in chunks
    between decode steps (:meth:`semkv.engine.Engine.advance_prefill`)."""

    name: str

    def load(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> LoadedRows:
        """Write the plan's reused leading rows into ``cache`` (empty)."""
        ...


def load_then_prefill(
    path: TailPrefillPath, ctx: PrefillContext, plan: Plan, cache: KVCache
) -> PrefillOutcome:
    """A :class:`TailPrefillPath`'s prefill in one piece: load, then prefill the remaining tokens."""
    loaded = path.load(ctx, plan, cache)
    logits = ctx.runtime.prefill(cache, plan.layout.token_ids[plan.reused_tokens :])
    return loaded.outcome(path.name, plan, logits)
