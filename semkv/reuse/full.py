"""Full prefill: every prompt token through every layer. The baseline every path is measured against."""

from __future__ import annotations

from semkv.models.cache import KVCache
from semkv.prompt import PromptLayout
from semkv.reuse.base import Plan, PrefillContext, PrefillOutcome
from semkv.reuse.options import ReuseOptions


class FullPrefill:
    name = "full"

    def plan(self, ctx: PrefillContext, options: ReuseOptions, layout: PromptLayout) -> Plan:
        return Plan(self.name, layout, reused_tokens=0)

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome:
        token_ids = plan.layout.token_ids
        logits = ctx.runtime.prefill(cache, token_ids)
        return PrefillOutcome(
            logits, self.name, reused_tokens=0, recomputed_tokens=len(token_ids), exact=True
        )

    def after_prefill(
        self,
        ctx: PrefillContext,
        options: ReuseOptions,
        layout: PromptLayout,
        cache: KVCache,
        outcome: PrefillOutcome,
    ) -> None:
        """Nothing of its own: an exact prefill is stored as prefix blocks by the prefix path."""
