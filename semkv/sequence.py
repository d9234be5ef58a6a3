"""One request in flight: its live KV cache and the tokens it has produced so far.

:meth:`semkv.engine.Engine.prefill` makes a :class:`Sequence` (layout, chosen plan, filled cache,
first token sampled); :meth:`~semkv.engine.Engine.decode_step` / :meth:`~semkv.engine.Engine.decode`
advance it; :meth:`~semkv.engine.Engine.store_prefill` keeps what its prefill made reusable;
:meth:`~semkv.engine.Engine.finish` turns it into a :class:`~semkv.request.Generation`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from semkv.models.cache import KVCache
from semkv.prompt import PromptLayout
from semkv.repetition import forming_repetition
from semkv.request import GenerateRequest
from semkv.reuse.base import LoadedRows, Plan, PrefillOutcome, Refusal
from semkv.reuse.options import ReuseOptions
from semkv.sparse.decoder import SparseDecoder
from semkv.sparse.index import BlockIndex, PrefillQueries

TokenCallback = Callable[[int], bool | None]  # a kept token id; returning False stops the generation


# The smallest temperature that still scales logits: float32's smallest normal number. A positive
# temperature below it is not a distribution's temperature (1 / T is not finite in float32); the server
# refuses it, and the sampler treats it as greedy.
MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)


class SamplingError(RuntimeError):
    """The logits of a step give no distribution to sample from (NaN, +inf, or every logit -inf)."""


def row_maxima(logits: Tensor) -> list[tuple[float, int]]:
    """Each row's largest logit (in float32) and the index of its first occurrence, for logits [B, V]: one
    reduction and one host read for a whole batched step, not a copy, a max and an argmax per row. A row
    holding NaN gets NaN (``max`` propagates it)."""
    values, indices = logits.float().max(dim=-1)
    return list(zip(values.tolist(), indices.tolist(), strict=True))


def sample_token(
    logits: Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    maximum: tuple[float, int] | None = None,
) -> int:
    """Greedy at temperature 0 (or below :data:`MIN_TEMPERATURE`), else temperature + nucleus sampling,
    in log space: the logits less their maximum, divided by the temperature, are in [-inf, 0], so no
    temperature overflows them and the most likely token always keeps a positive probability (a
    temperature so small that every other token underflows is greedy). The nucleus always keeps the most
    likely token, however small ``top_p``. logits: [V]; maximum: their largest value and its first index
    when already known (:func:`row_maxima`), else computed here. Raises :class:`SamplingError` for NaN
    or +inf logits, or when every logit is -inf."""
    # NaN if any logit is NaN (max propagates it): one host read checks both
    largest, first = row_maxima(logits.unsqueeze(0))[0] if maximum is None else maximum
    if math.isnan(largest):
        raise SamplingError("the step's logits contain NaN")
    if not math.isfinite(largest):
        raise SamplingError(f"the step's largest logit is {largest}")
    if temperature < MIN_TEMPERATURE:
        return first
    probs = torch.softmax((logits.float() - largest) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@dataclass
class PrefillJob:
    """A request between planning and its first token (:meth:`semkv.engine.Engine.begin_prefill`).

    computed: prompt tokens in the cache so far (reused rows once loaded, then computed rows, in
    ``chunks`` pieces). tail_prefill: the plan's path loads its reused leading rows and prefills the
    rest exactly (full prefill, prefix reuse: :class:`semkv.reuse.base.TailPrefillPath`); without query
    capture such a job advances in chunks (``chunkable``): each chunk appends its rows and attends to
    every row before it, masks from positions. Blend, share and query capture run in one piece.
    loaded: what the path's load put in the cache (set by the first chunk).
    outcome: set once the whole prompt is computed.
    """

    request: GenerateRequest
    options: ReuseOptions
    layout: PromptLayout
    plan: Plan
    refusals: list[Refusal]
    cache: KVCache
    sparse: SparseDecoder | None
    kv_budget: float | int
    capture: bool
    started: float
    tail_prefill: bool = False
    computed: int = 0
    chunks: int = 0
    loaded: LoadedRows | None = None
    outcome: PrefillOutcome | None = None
    queries: PrefillQueries | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def chunkable(self) -> bool:
        return self.tail_prefill and not self.capture

    @property
    def done(self) -> bool:
        return self.outcome is not None

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute (reused rows are not computed)."""
        if self.done:
            return 0
        return len(self.layout) - max(self.computed, self.plan.reused_tokens if self.tail_prefill else 0)


@dataclass
class Sequence:
    """A prefilled request and its generation so far.

    tokens: every token sampled (or fed, under teacher forcing) so far; ``tokens[-1]`` is the next
        one to feed (not yet in the cache). The cache holds the prompt + ``tokens[:-1]``.
    outcome: what the prefill did (path, reused/recomputed tokens, first-token logits [V]).
    sparse: the request's sparse decoder, or None for dense decoding.
    prefill_queries: queries captured at prefill (when asked for), so a fork can run SnapKV / H2O.
    blocks: summaries of the cache's complete blocks (the sparse decoder reads and extends them);
        summarise_s: the time summarising the prompt's blocks took. They are summarised after the first
        token (never part of the TTFT): before a sparse request's first decode step, or when a dense
        request's prompt is stored or it is forked (where ``capture_queries`` asked a dense request for
        its prefill's queries, with the prefill).
    failure: what ended this sequence alone in a batched step (its sampling, loop repair or sparse
        selection raised: :meth:`semkv.engine.Engine.decode_batch`); the scheduler ends it with this
        error while the other sequences of the step go on.
    emitted: how many of ``tokens`` were emitted (handed to a streaming callback, or passed over without
        one). delivered: how many a callback received: they are the client's and are never taken back
        (:mod:`semkv.loop_repair` may drop later ones).
    """

    request: GenerateRequest
    options: ReuseOptions
    layout: PromptLayout
    plan: Plan
    refusals: list[Refusal]
    outcome: PrefillOutcome
    cache: KVCache
    sparse: SparseDecoder | None
    generator: torch.Generator
    eos_ids: frozenset[int]
    kv_budget: float | int
    tokens: list[int] = field(default_factory=list)
    prefill_queries: PrefillQueries | None = None
    blocks: BlockIndex | None = None
    ttft_s: float = 0.0
    summarise_s: float = 0.0
    decode_s: float = 0.0
    store_s: float = 0.0
    stored: bool = False
    emitted: int = 0
    delivered: int = 0
    stop_requested: bool = False
    failure: BaseException | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    # -- state -----------------------------------------------------------------------------------
    @property
    def first_logits(self) -> Tensor:
        """float32 logits [V] of the first generated token."""
        return self.outcome.logits

    @property
    def prompt_tokens(self) -> int:
        return len(self.layout)

    def ends_with_eos(self) -> bool:
        return self.request.stop_at_eos and bool(self.tokens) and self.tokens[-1] in self.eos_ids

    @property
    def finish_reason(self) -> str | None:
        """None while running; else "stop" (a callback asked), "eos" or "length"."""
        if self.stop_requested:
            return "stop"
        if self.ends_with_eos():
            return "eos"
        if len(self.tokens) >= self.request.max_new_tokens:
            return "length"
        return None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output_ids(self) -> list[int]:
        """The generated tokens a user sees: without a final EOS."""
        return self.tokens[:-1] if self.ends_with_eos() else list(self.tokens)

    # -- streaming ---------------------------------------------------------------------------------
    def emit_pending(self, on_token: TokenCallback | None) -> None:
        """Hand the tokens not yet emitted to ``on_token`` (a final EOS is not handed over); a callback
        returning False stops the sequence there. A repetition forming at the end of an answer that loop
        repair may roll back is held until it breaks or the answer ends (:meth:`held_tokens`)."""
        if on_token is None:
            self.emitted = len(self.tokens)
            return
        limit = len(self.tokens) - self.held_tokens()
        while self.emitted < limit and not self.stop_requested:
            token = self.tokens[self.emitted]
            self.emitted += 1
            self.delivered = self.emitted
            if self.request.stop_at_eos and token in self.eos_ids:
                break
            if on_token(token) is False:
                self.stop_requested = True

    def held_tokens(self) -> int:
        """Tokens at the end of the answer not to hand to a callback yet: a repetition forming in an answer
        loop repair may still roll back (:func:`semkv.repetition.forming_repetition`); 0 once the sequence
        finished or when it cannot be repaired. Delivered tokens are the client's and are never rolled back,
        so without this a streamed loop (or a server's, whose steps hand every token on) could only be
        repaired from its third copy on."""
        if self.outcome is None:  # a stand-in without a prefill (the scheduler's tests)
            return 0
        if self.finished or not self.wants_loop_repair():
            return 0
        return forming_repetition(self.tokens)

    def wants_loop_repair(self) -> bool:
        """The answer comes from inexact KV, is decoded densely, asks for repair (:mod:`semkv.loop_repair`),
        has none yet and was not ended by EOS or a client. One that just reached ``max_new_tokens`` still
        qualifies: the rollback makes room, and decoding goes on."""
        assert self.outcome is not None, "loop repair is asked of a sequence after its prefill"
        return (
            self.request.repair_loops
            and not self.outcome.exact
            and self.sparse is None
            and "loop_repair" not in self.notes
            and not self.stop_requested
            and not self.ends_with_eos()
        )

    def sample(self, logits: Tensor, maximum: tuple[float, int] | None = None) -> int:
        """Sample the next token from ``logits`` [V] with the request's settings and append it (maximum:
        see :func:`sample_token`)."""
        token = sample_token(logits, self.request.temperature, self.request.top_p, self.generator, maximum)
        self.tokens.append(token)
        return token

    # -- result ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The figures ``Generation.stats`` reports (timings, token counts, the path and why)."""
        generated = self.output_ids()
        return {
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "decode_ms_per_token": 1000 * self.decode_s / max(1, len(generated) - 1),
            "store_s": self.store_s,
            "prefill_summarise_s": self.summarise_s,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(generated),
            "reused_tokens": self.outcome.reused_tokens,
            "recomputed_tokens": self.outcome.recomputed_tokens,
            "path": self.outcome.path,
            "refused": {r.path: r.reason for r in self.refusals},
            "finish_reason": self.finish_reason,
            **self.notes,
            **self.outcome.info,
            **(self.sparse.stats(self.decode_s) if self.sparse is not None else {}),
        }
