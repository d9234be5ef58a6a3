"""Selective recompute: the mechanism CacheBlend and SemShareKV share.

Both paths pre-load reused KV into the cache rows (re-rotated to the new positions) and run
:meth:`Runtime.forward_rows` with a :class:`SelectiveRecompute`. At every layer listed in
``schedule`` it asks its :class:`~semkv.reuse.selection.base.RowSelector` to score the still-active
reusable rows and keeps the best ``ratio`` of all reusable rows; ``forced`` rows (uncached tokens:
question, template, separators, unmatched tokens) are always kept. Layers before the first scheduled
layer recompute every row (layer 0 always does). Selectors that rank by the question's attention
(``needs_probe``) get the scores of a :class:`QueryProbe` pass run just before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from semkv.models.runtime import LayerInputs
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
        self.num_reusable = int((~self.rows.forced).sum())

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
        forced = self.rows.forced[active]
        candidates = (~forced).nonzero().squeeze(1)
        budget = min(math.ceil(self.schedule[layer] * self.num_reusable), int(candidates.numel()))
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
        return keep

    def recomputed_rows(self) -> Tensor:
        """Row offsets recomputed through the deepest scheduled layer (forced rows included)."""
        if not self.chosen:
            return torch.arange(self.rows.forced.numel())
        return self.chosen[max(self.chosen)]


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
    heads and query rows into ``scores`` [T]. After the last probe layer only the last row goes on
    (the runtime needs one; its logits are not used). The forced rows' KV it writes is overwritten by
    the recompute that follows (forced rows are recomputed at every layer).
    """

    rows: RowInfo
    layers: tuple[int, ...]
    scores: Tensor = field(init=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a query probe needs at least one layer")
        self.scores = torch.zeros(self.rows.forced.numel(), dtype=torch.float32)
        self.last = max(self.layers)

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
        if layer in self.layers and inputs.window is None:
            self._record(active, inputs)
        if layer >= self.last:
            keep = keep[-1:]
        return keep

    def _record(self, active: Tensor, inputs: LayerInputs) -> None:
        asking = self.rows.query[active]
        if not bool(asking.any()):
            return
        mass = query_attention(
            inputs.rotated_queries()[:, asking],
            inputs.keys.float(),
            inputs.q_pos[asking],
            inputs.k_pos,
            inputs.scaling,
        )
        own = mass[inputs.first_row : inputs.first_row + self.scores.numel()]
        self.scores[: own.numel()] += own.to(self.scores.device, torch.float32)


def query_attention(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scaling: float) -> Tensor:
    """Attention mass [Tk] each key receives, summed over heads and queries (causal by positions).

    q: [nh, Q, d] rotated queries; k: [kvh, Tk, d] rotated keys (kvh divides nh).
    """
    nh, nq, d = q.shape
    kvh = k.shape[0]
    logits = torch.matmul(q.reshape(kvh, (nh // kvh) * nq, d), k.transpose(1, 2)) * scaling
    visible = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).repeat(nh // kvh, 1)  # [rep * Q, Tk]
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits.float(), dim=-1).sum(dim=(0, 1))
