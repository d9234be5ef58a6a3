"""Selective recompute: the mechanism CacheBlend and SemShareKV share.

Both paths pre-load reused KV into the cache rows (re-rotated to the new positions) and run
:meth:`Runtime.forward_rows` with a :class:`SelectiveRecompute`. At every layer listed in
``schedule`` it asks its :class:`~semkv.reuse.selection.base.RowSelector` to score the still-active
reusable rows and keeps the best ``ratio`` of all reusable rows; ``forced`` rows (uncached tokens:
question, template, separators not stored with their chunk, unmatched tokens) are always kept. Layers
before the first scheduled layer recompute every row (layer 0 always does). Selectors that rank by the
question's attention (``needs_probe``) get the scores of a :class:`QueryProbe` pass run just before.
The probe, and a recompute whose rows are known before the forward
(:meth:`SelectiveRecompute.preselect`), run through :func:`forward_fixed_rows`: only their rows, from
layer 0 on, with ``forward_rows``' arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.kernels import GemmPlans
from semkv.models.runtime import Attention, LayerInputs, Runtime, attention
from semkv.reuse.selection.base import ContextScaling, RowInfo, RowSelector, ScoreView
from semkv.reuse.selection.deviation import DeviationSelector

DeviationOn = Literal["k", "v", "kv"]


def check_schedule(schedule: dict[int, float]) -> None:
    for layer, ratio in schedule.items():
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"recompute ratio {ratio} at layer {layer} outside [0, 1]")


@dataclass
class SelectiveRecompute:
    """The runtime's recompute selector for one forward: forced rows plus the top fraction of the
    reusable rows by ``selector``'s score.

    rows: what each row is (forced [T] included). schedule: layer -> fraction of *all reusable rows*
        kept from that layer on; layers not listed keep every active row. Fractions should not grow
        with depth. probe: [T] scores of a :class:`QueryProbe` pass, for ``needs_probe`` selectors.
    attention: None, or a :class:`ContextScaling` ``forward_rows`` attends with instead of the plain
        kernel (the selector's APE-style temperature / scale).
    chosen / scores: filled in: layer -> row offsets kept there / the candidates' scores.
    """

    rows: RowInfo
    schedule: dict[int, float]
    selector: RowSelector
    probe: Tensor | None = None
    attention: ContextScaling | None = None
    chosen: dict[int, Tensor] = field(default_factory=dict)
    scores: dict[int, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_schedule(self.schedule)
        self.num_reusable = int(self.rows.reusable.sum())
        self.candidates_left: int | None = None  # reusable rows still active after the last scheduled layer
        self.first_scheduled = min(self.schedule, default=None)  # where a forward starts ranking afresh

    @property
    def forced(self) -> Tensor:
        return self.rows.forced

    def select(
        self,
        layer: int,
        active: Tensor,
        fresh_k: Tensor,
        fresh_v: Tensor,
        cached_k: Tensor,
        cached_v: Tensor,
        inputs: LayerInputs,
    ) -> Tensor:
        if layer not in self.schedule:
            return torch.arange(active.numel(), device=active.device)
        return self._keep(layer, active, fresh_k, fresh_v, cached_k, cached_v, inputs)

    def compares_at(self, layer: int) -> bool:
        """Whether :meth:`select` reads the reused KV at ``layer``: only at scheduled layers (elsewhere
        every active row goes on) whose budget is smaller than the reusable rows still active (a budget
        covering them all keeps them without ranking: a decaying schedule at its floor), so the runtime
        gathers it for no other layer."""
        if layer not in self.schedule:
            return False
        left = self.candidates_left  # at the first scheduled layer, a previous forward's count (if any)
        return layer == self.first_scheduled or left is None or self._budget(layer) < left

    def _budget(self, layer: int) -> int:
        return math.ceil(self.schedule[layer] * self.num_reusable)

    def preselect(self) -> Tensor | None:
        """The rows [K] (offsets, ascending) kept through every layer, when the choice needs nothing a
        forward computes: the only check layer is 0 and the selector does not rank by KV deviation
        (``query``, ``chunk-start``, ``random``); None otherwise. The recompute then runs just these rows
        from layer 0 on (:func:`forward_fixed_rows`) instead of every row through layer 0's projections:
        the others keep their reused KV at every layer, layer 0 included, where it is the KV a forward
        writes (a token's layer-0 keys and values do not depend on its context)."""
        if set(self.schedule) != {0} or self.selector.uses_deviation:
            return None
        return self._keep(0, torch.arange(self.rows.forced.numel(), device=self.rows.forced.device))

    def _keep(
        self,
        layer: int,
        active: Tensor,
        fresh_k: Tensor | None = None,
        fresh_v: Tensor | None = None,
        cached_k: Tensor | None = None,
        cached_v: Tensor | None = None,
        inputs: LayerInputs | None = None,
    ) -> Tensor:
        """Indices into ``active`` of the forced rows and the best of the candidates at ``layer``."""
        forced = self.rows.forced[active]
        candidates = self.rows.reusable[active].nonzero().squeeze(1)
        budget = min(self._budget(layer), candidates.numel())
        if budget >= candidates.numel():
            top = candidates  # a budget covering every candidate needs no ranking (ratio 1)
        elif budget == 0:
            top = candidates[:0]
        else:
            view = ScoreView(
                layer,
                active,
                candidates,
                budget,
                self.rows,
                fresh_k,
                fresh_v,
                cached_k,
                cached_v,
                inputs,
                self.probe,
            )
            score = self.selector.score(view).to(torch.float32)
            self.scores[layer] = score
            values, order = torch.topk(score, budget)
            top = candidates[order[torch.isfinite(values)]]
        keep = torch.cat([forced.nonzero().squeeze(1), top]).sort().values
        self.chosen[layer] = active[keep]
        self.candidates_left = int(top.numel())
        return keep

    def recomputed_rows(self) -> Tensor:
        """Row offsets computed in place through the deepest scheduled layer: forced rows, the selected
        ones, and the settled rows (computed by the probe)."""
        if not self.chosen:
            return torch.arange(self.rows.forced.numel(), device=self.rows.forced.device)
        settled = self.rows.settled.nonzero().squeeze(1).to(self.chosen[max(self.chosen)].device)
        return torch.cat([self.chosen[max(self.chosen)], settled]).sort().values


def deviation_recompute(
    forced: Tensor, schedule: dict[int, float], on: DeviationOn = "v"
) -> SelectiveRecompute:
    """CacheBlend's / SemShareKV's recompute: the rows with the largest KV deviation (no layout needed)."""
    return SelectiveRecompute(RowInfo.plain(forced), schedule, DeviationSelector(on=on))


@dataclass
class QueryProbe:
    """A pass before the selective recompute that scores every row by the question's attention to it.

    Only the forced rows are computed (from layer 0 on; the reused rows keep their stored KV), so the
    question attends to the reused chunk KV as it is. At each of ``layers`` (skipping layers with a
    sliding window) the attention weights of the ``rows.query`` rows to every row are summed over
    heads and query rows into ``scores`` [T]: taken from the layer's own attention of the question rows
    (:meth:`attention`, which ``forward_rows`` calls instead of the kernel), so the question's logits and
    softmax are computed once per layer; at the last probe layer (after which only the last row goes
    on: the runtime needs one, its logits are not used) they are computed apart, before the narrowing.
    The forced rows' KV it writes is overwritten by the recompute that follows (forced rows are
    recomputed at every layer), except the rows before the first chunk (:meth:`exact_rows`), whose KV it
    computes exactly.
    """

    rows: RowInfo
    layers: tuple[int, ...]
    scores: Tensor = field(init=False)
    compares_cached = False  # the runtime need not gather the reused KV of its rows for it

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a query probe needs at least one layer")
        forced = self.rows.forced
        self.scores = torch.zeros(forced.numel(), dtype=torch.float32, device=forced.device)
        # read once, before the layers: the probe computes the forced rows, among them every question row
        self._asks = bool(self.rows.query.any())
        self._others = bool((forced & ~self.rows.query).any())
        self.last = max(self.layers)
        self._asking: Tensor | None = None  # [A] query rows among the rows the next attention computes
        self._first_row = 0

    def select(
        self,
        layer: int,
        active: Tensor,
        fresh_k: Tensor,
        fresh_v: Tensor,
        cached_k: Tensor,
        cached_v: Tensor,
        inputs: LayerInputs,
    ) -> Tensor:
        keep = self.rows.forced[active].nonzero().squeeze(1)
        self.observe(layer, active, keep, inputs)
        return keep[-1:] if layer >= self.last else keep

    def observe(self, layer: int, active: Tensor, keep: Tensor, inputs: LayerInputs) -> None:
        """Before ``layer``'s attention of rows ``active[keep]``: on the last probe layer record the question
        rows' attention (from ``inputs``, over the active rows); on the others let :meth:`attention`
        record it as it computes it."""
        self._asking = None
        if layer in self.layers and inputs.window is None:
            if layer >= self.last:
                self._record(active, inputs)
            else:
                asking = self.rows.query[active[keep]]
                self._asking, self._first_row = (asking if self._asks else None), inputs.first_row

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        scaling: float,
        window: int | None = None,
        causal_prefix: bool = False,
        plans: GemmPlans | None = None,
    ) -> Tensor:
        """:func:`semkv.models.runtime.attention` for ``forward_rows``; on a recording layer the question
        rows' attention is computed here (:func:`question_attention`) and its weights recorded."""
        asking, self._asking = self._asking, None
        if asking is None:
            return attention(q, k, v, q_pos, k_pos, scaling, window, causal_prefix, plans=plans)
        out = q.new_empty(q.shape[1], q.shape[0] * q.shape[2])
        others = ~asking
        if self._others:
            out[others] = attention(q[:, others], k, v, q_pos[others], k_pos, scaling, window)
        out[asking], mass = question_attention(q[:, asking], k, v, q_pos[asking], k_pos, scaling)
        self._add(mass, self._first_row)
        return out

    def _record(self, active: Tensor, inputs: LayerInputs) -> None:
        if not self._asks:
            return
        asking = self.rows.query[active]
        # rotated in fp32 and rounded to the compute dtype, as the layer's own attention sees them
        queries = inputs.rotated_queries()[:, asking].to(inputs.keys.dtype)
        _, mass = question_attention(
            queries, inputs.keys, None, inputs.q_pos[asking], inputs.k_pos, inputs.scaling
        )
        self._add(mass, inputs.first_row)

    def settled_rows(self, num_layers: int) -> Tensor:
        """[T] bool: the forced rows other than the question and the last row, whose KV this probe computed
        at every one of ``num_layers`` layers (so they need no recompute); none if it stopped earlier."""
        settled = self.rows.forced & ~self.rows.query
        settled[-1:] = False
        return settled if self.last >= num_layers - 1 else torch.zeros_like(settled)

    def exact_rows(self, num_layers: int) -> Tensor:
        """[T] bool: the forced rows before the first reused row (the chat template's head before the first
        chunk), other than the question and the last row, if this probe computed every one of
        ``num_layers`` layers. They attend only to each other, so the KV the probe wrote for them is
        final (what full prefill computes) and a recompute would compute it again; none otherwise.
        A subset of :meth:`settled_rows`."""
        exact = self.settled_rows(num_layers)
        reused = (~self.rows.forced).nonzero()
        exact[int(reused[0]) if reused.numel() else 0 :] = False
        return exact

    def _add(self, mass: Tensor, first_row: int) -> None:
        own = mass[first_row : first_row + self.scores.numel()]
        self.scores[: own.numel()] += own.to(torch.float32)


def forward_fixed_rows(
    runtime: Runtime,
    cache: KVCache,
    start: int,
    rows: Tensor,
    attend: Attention = attention,
    probe: QueryProbe | None = None,
) -> Tensor | None:
    """Run a fixed set of cache rows through the layers; every other row keeps the KV it holds.

    rows: [R] offsets from ``start`` (ascending; the cache's last row last when logits are wanted).
    :meth:`Runtime.forward_rows` over just these rows from layer 0 on, without the per-layer gathers of
    reused KV a deviation selector compares: for a recompute whose rows are known before the forward
    (:meth:`SelectiveRecompute.preselect`) and for a :class:`QueryProbe` (its forced rows, which it tells
    about at every layer and whose attention it computes; it stops after its last layer). Returns the last
    row's logits [V], or None for a probe.
    """
    if probe is None:
        return runtime.forward_rows(cache, start, rows=rows, attend=attend)
    return runtime.forward_rows(cache, start, probe, rows=rows, stop_after=probe.last)


def question_attention(
    q: Tensor, k: Tensor, v: Tensor | None, q_pos: Tensor, k_pos: Tensor, scaling: float
) -> tuple[Tensor | None, Tensor]:
    """Attention of a few query rows over every key (causal by positions, no window), and the attention
    mass each key receives.

    q: [nh, Q, d] rotated queries; k, v: [kvh, Tk, d] rotated keys and values (kvh divides nh), in one
    dtype. The logits are computed in that dtype, as :func:`semkv.models.kernels.gemm_attention`
    computes the model's own (queries scaled first, one 2-D matmul per KV head); softmax and the mass
    run in float32, the probabilities are rounded to v's dtype for the output. The causal mask is applied
    only to the keys after the first query's position (a question sees every context key).
    Returns (output [Q, nh * d] in q's dtype, or None without ``v``; mass [Tk] float32, summed over
    heads and queries).
    """
    nh, nq, d = q.shape
    kvh = k.shape[0]
    rep = nh // kvh
    rows = (q * scaling).reshape(kvh, rep * nq, d)  # query heads of one KV head folded into rows
    late = (k_pos > q_pos.min()).nonzero().squeeze(1)
    hidden = k_pos[late].unsqueeze(0) > q_pos.unsqueeze(1)  # [Q, late]: keys after the query
    mass = torch.zeros(k.shape[1], dtype=torch.float32, device=k.device)
    out = None if v is None else q.new_empty(nq, kvh, rep, d)
    for head in range(kvh):
        logits = torch.mm(rows[head], k[head].t())  # [rep * Q, Tk]
        if late.numel():
            block = logits[:, late].view(rep, nq, -1).masked_fill(hidden, float("-inf"))
            logits[:, late] = block.view(rep * nq, -1)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)  # no float32 copy of the logits first
        mass += weights.sum(dim=0)
        if out is not None and v is not None:
            out[:, head] = torch.mm(weights.to(v.dtype), v[head]).view(rep, nq, d).transpose(0, 1)
    return (None if out is None else out.reshape(nq, nh * d)), mass


def query_attention(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scaling: float) -> Tensor:
    """Attention mass [Tk] (float32) each key receives from the queries q [nh, Q, d], summed over heads and
    queries (:func:`question_attention` without values)."""
    return question_attention(q, k, None, q_pos, k_pos, scaling)[1]
