"""Query probe: blocks ranked by the model's own queries, not by an anchor of recent keys.

Key-Key's anchor (the mean key of the last tokens) says what the *text* at the end is about; the
model's queries say what it is *looking for*. Under the chat template the last tokens are template
tokens ("<|im_end|> <|im_start|>assistant ..."), whose keys resemble other template and instruction
tokens, not the needle, so Key-Key keeps the wrong blocks (``semkv bench sparse --suite ruler``).

Two probes share the budget:

* the **question** (``prompt_share`` of the budget, chosen once): the queries of the prompt's last
  ``window`` tokens (captured at prefill: the question and the answer's lead-in), their exact attention
  over the prompt's blocks at every selecting layer, computed once when the decoder attaches. This is
  what the question asks for — e.g. all four keys of a multi-query question — and it does not drift.
* the **step** (the rest, every step): the rotated queries of every selecting layer at the latest step
  whose queries are complete — the previous decode step (the prompt's last token at the first step) —
  against each block's mean rotated key, a write-time summary (``q . k_mean`` is exactly the mean logit
  of the block's keys). One batched matrix product per step, before layer 0 attends, so selection stays
  one choice per step.

Per block, layer and query head the estimate is a softmax over blocks; ``head_agg="max"`` scores a block
by its best head in each layer (a retrieval head that alone looks at a needle counts fully), ``"mass"``
by the heads' mean; layers (and question tokens) are averaged. ``per_layer=True`` instead scores each
layer with its own current query (exact, but one selection and one fast-tier map per layer).

Residency: blocks selected in the last ``keep_steps`` steps stay resident when unselected (the step
probe lags a step, so a block it just dropped is likely wanted again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.sparse.base import SparsePolicy, StepView

HEAD_AGGREGATES = ("max", "mass")


def aggregate_heads(probs: Tensor, head_agg: str) -> Tensor:
    """[..., heads, C] per-head block distributions -> [..., C]."""
    return probs.amax(dim=-2) if head_agg == "max" else probs.mean(dim=-2)


def mean_key_scores(q: Tensor, means: Tensor, head_agg: str) -> Tensor:
    """q: [L', nh, d] queries; means: [L', kvh, C, d] block mean rotated keys -> [L', C] per-layer scores
    (softmax over blocks of the mean logits, per head, heads aggregated)."""
    num_layers, kvh, d = means.shape[0], means.shape[1], means.shape[-1]
    logits = q.reshape(num_layers, kvh, -1, d) @ means.transpose(-1, -2)  # [L', kvh, g, C]
    probs = torch.softmax(logits.flatten(1, 2) / math.sqrt(d), dim=-1)  # [L', nh, C]
    return aggregate_heads(probs, head_agg)


def window_block_scores(q: Tensor, keys: Tensor, block_size: int, num_blocks: int, head_agg: str) -> Tensor:
    """Exact attention of window queries over the prompt, per block: q [nh, n, d] (rotated, the prompt's
    last n tokens), keys [kvh, T, d] (rows in position order, T >= num_blocks * block_size; the queries
    are the last n of them) -> [num_blocks], heads aggregated, mean over the queries."""
    kvh, total, d = keys.shape
    nh, n, _ = q.shape
    logits = q.reshape(kvh, -1, n, d) @ keys.transpose(1, 2).unsqueeze(1) / math.sqrt(d)  # [kvh, g, n, T]
    rows = torch.arange(total)
    visible = rows.unsqueeze(0) <= (total - n + torch.arange(n)).unsqueeze(1)  # causal: [n, T]
    probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1).reshape(nh, n, total)
    mass = probs[..., : num_blocks * block_size].reshape(nh, n, num_blocks, block_size).sum(-1)
    return aggregate_heads(mass.transpose(0, 1), head_agg).mean(dim=0)  # [nh, n, B] -> [n, B] -> [B]


@dataclass
class ProbePolicy(SparsePolicy):
    """The question's and the latest step's queries against the blocks (see the module docstring).

    head_agg: "max" or "mass" over a layer's query heads.
    prompt_share: share of the budget chosen by the question probe (0: step probe only).
    window: question tokens (the prompt's last ones) whose queries form the question probe.
    per_layer: score each layer with its current query (no question probe).
    keep_steps: steps a selected block stays resident after it was last selected.
    """

    name = "probe"
    needs_prefill_queries = True  # the question probe and the first step's probe
    head_agg: str = "max"
    prompt_share: float = 0.5
    window: int = 16
    per_layer_query: bool = False
    keep_steps: int = 4
    _queries: dict[int, Tensor] = field(default_factory=dict, repr=False)
    _question: Tensor | None = field(default=None, repr=False)
    _last_selected: list[Tensor] = field(default_factory=list, repr=False)
    _num_blocks: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.head_agg not in HEAD_AGGREGATES:
            raise ValueError(f"head_agg must be one of {HEAD_AGGREGATES}, got {self.head_agg!r}")
        if not 0.0 <= self.prompt_share <= 1.0:
            raise ValueError(f"prompt_share must be in [0, 1], got {self.prompt_share}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.keep_steps < 0:
            raise ValueError(f"keep_steps must be >= 0, got {self.keep_steps}")

    @property
    def per_layer(self) -> bool:
        return self.per_layer_query

    def prepare(self, view: StepView) -> None:
        """The first step's probe (the prompt's last token's queries) and the question's block scores."""
        if view.prefill is None or not view.prefill.q:
            raise ValueError("probe needs the prompt's queries captured at prefill")
        self._queries = {layer: view.prefill.q[layer][:, -1] for layer in view.selecting}
        self._last_selected = []
        self._question = None
        if self.prompt_share > 0 and not self.per_layer_query and view.selecting:
            self._question = self._question_scores(view)

    def _question_scores(self, view: StepView) -> Tensor:
        """[prompt blocks] mean over selecting layers of the question queries' block attention."""
        prefill = view.prefill
        assert prefill is not None
        num_blocks = view.index.num_complete
        rows = prefill.last_position() + 1
        scores = []
        for layer in view.selecting:
            positions = prefill.positions[layer]
            tail = positions[-self.window :]
            if int(tail[0]) != rows - tail.numel() or int(tail[-1]) != rows - 1:
                continue  # this layer's captured rows are not the prompt's last ones (selective recompute)
            q = prefill.q[layer][:, -tail.numel() :]
            keys = view.cache.keys(layer)[:, :rows]
            scores.append(window_block_scores(q, keys, view.index.block_size, num_blocks, self.head_agg))
        return torch.stack(scores).mean(dim=0) if scores else torch.zeros(num_blocks)

    def see_query(self, layer: int, q_rot: Tensor) -> None:
        self._queries[layer] = q_rot[:, 0]

    def score(self, view: StepView) -> Tensor:
        span = view.candidate_span()
        if self.per_layer_query:
            assert view.layer is not None and view.q_rot is not None
            means = view.index.summary("rmean")[view.layer : view.layer + 1, :, span]
            return mean_key_scores(view.q_rot[:, 0].unsqueeze(0), means, self.head_agg)[0]
        layers = view.selecting or tuple(sorted(self._queries))
        means = view.index.summary("rmean")[list(layers)][:, :, span]  # [L', kvh, C, d]
        q = torch.stack([self._queries[layer] for layer in layers])  # [L', nh, d]
        step = mean_key_scores(q, means, self.head_agg).mean(dim=0)  # [C], sums to <= 1
        scores = self._with_question(view, step)
        self._remember(view, scores)
        return scores

    def _with_question(self, view: StepView, step: Tensor) -> Tensor:
        """The question's top ``prompt_share`` of the budget first (scores lifted above every step
        score), then the step probe's order for the rest."""
        if self._question is None:
            return step
        reserved = int(round(self.prompt_share * view.budget))
        known = view.candidates < self._question.numel()
        question = torch.zeros_like(step)
        question[known] = self._question[view.candidates[known]]
        if reserved <= 0:
            return step
        top = torch.topk(question, min(reserved, question.numel())).indices
        lifted = step.clone()
        lifted[top] = 2.0 + question[top]  # step scores are <= 1
        return lifted

    def _remember(self, view: StepView, scores: Tensor) -> None:
        """Keep this step's choice (the decoder's top-k of the same scores) for residency."""
        self._num_blocks = view.index.num_complete
        if self.keep_steps:
            top = view.candidates[torch.topk(scores, min(view.budget, scores.numel())).indices]
            self._last_selected = ([top] + self._last_selected)[: self.keep_steps]

    def resident_hint(self) -> Tensor | None:
        if not self._last_selected or self._num_blocks == 0:
            return None
        hint = torch.full((self._num_blocks,), -1.0)
        for age, selected in enumerate(reversed(self._last_selected)):
            hint[selected[selected < self._num_blocks]] = float(age + 1)
        return hint
