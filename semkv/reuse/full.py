"""Full prefill: every prompt token through every layer. The baseline every path is measured against."""

from __future__ import annotations

from semkv.models.cache import KVCache
from semkv.prompt import PromptLayout
from semkv.request import GenerateRequest
from semkv.reuse.base import Plan, PrefillContext, PrefillOutcome, register_path


class FullPrefill:
    name = "full"

    def plan(self, ctx: PrefillContext, request: GenerateRequest, layout: PromptLayout) -> Plan:
        return Plan(self.name, layout, reused_tokens=0)

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome:
        token_ids = plan.layout.token_ids
        logits = ctx.runtime.prefill(cache, token_ids)
        return PrefillOutcome(
            logits, self.name, reused_tokens=0, recomputed_tokens=len(token_ids), exact=True
        )


register_path(FullPrefill())
