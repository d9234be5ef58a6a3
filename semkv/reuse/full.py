"""Full prefill: every prompt token through every layer. The baseline every path is measured against."""

from __future__ import annotations

from semkv.models.cache import KVCache
from semkv.prompt import PromptLayout
from semkv.reuse.base import LoadedRows, Plan, PrefillContext, PrefillOutcome, load_then_prefill
from semkv.reuse.options import ReuseOptions


class FullPrefill:
    name = "full"

    def plan(self, ctx: PrefillContext, options: ReuseOptions, layout: PromptLayout) -> Plan:
        return Plan(self.name, layout, reused_tokens=0)

    def load(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> LoadedRows:
        """Nothing is reused: every row is computed by the prefill that follows."""
        return LoadedRows()

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome:
        return load_then_prefill(self, ctx, plan, cache)

    def after_prefill(
        self,
        ctx: PrefillContext,
        options: ReuseOptions,
        layout: PromptLayout,
        cache: KVCache,
        outcome: PrefillOutcome,
    ) -> None:
        """Nothing of its own: an exact prefill is stored as prefix blocks by the prefix path."""
