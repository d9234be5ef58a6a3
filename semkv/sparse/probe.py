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
by the heads' mean; layers (and question tokens) are averaged. ``groups`` splits the selecting layers
into contiguous groups with a selection each; ``split_at`` splits them at chosen layers (a new probe, the
first layer's current query with the previous step's queries of the layers above, selects for the layers
from there up: where one shared choice cannot serve the upper layers, whose attention overlaps little with
the lower layers' choice); ``exact_layers`` scores chosen layers with their own
current query (below).

``exact_layers`` gives chosen layers their own selection, scored with their own current query just before
they attend; the selecting layers between them keep one shared choice per contiguous run (chosen at the
run's first layer). On SmolLM2 layers 3-10 attend most selectively: there the once-per-step choice keeps
half the attention mass a per-layer choice keeps. ``exact_keys`` scores those layers by the
exact attention of the current query over every cached key instead of the blocks' mean keys.

``rescore`` checks the mean-key ranking exactly, at any layer group: the blocks' mean keys shortlist
``rescore x budget`` candidates (besides the question's reserved ones), and the group's queries — the same
ones that ranked them — score each shortlisted block by its exact share of their attention over the rows
read: the shortlisted blocks' keys, the sink and the window (the rows every step attends to anyway, so the
softmax is normalised much as over the whole cache). Only the shortlisted blocks' keys are read.

Residency: blocks selected in the last ``keep_steps`` steps stay resident when unselected (the step
probe lags a step, so a block it just dropped is likely wanted again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.models.cache import KVCache
from semkv.sparse.base import SparsePolicy, StepView
from semkv.sparse.index import CHUNK_BLOCKS

HEAD_AGGREGATES = ("max", "mass")
QUESTION_LIFT = 2.0  # the question's reserved candidates score this + their question score, above any step
# score (a softmax share, <= 1)


def aggregate_heads(probs: Tensor, head_agg: str) -> Tensor:
    """[..., heads, C] per-head block distributions -> [..., C]."""
    return probs.amax(dim=-2) if head_agg == "max" else probs.mean(dim=-2)


def layer_rows(summary: Tensor, layers: tuple[int, ...]) -> Tensor:
    """``summary[layers]`` as a view when the layers are evenly spaced (all layers; Gemma's global
    layers), else a copy."""
    if len(layers) > 1 and len({b - a for a, b in zip(layers, layers[1:], strict=False)}) == 1:
        return summary[layers[0] : layers[-1] + 1 : layers[1] - layers[0]]
    return summary[list(layers)]


def mean_key_scores(q: Tensor, means: Tensor, head_agg: str) -> Tensor:
    """q: [L', nh, d] queries; means: [L', kvh, C, d] block mean rotated keys -> [L', C] per-layer scores
    (softmax over blocks of the mean logits, per head, heads aggregated). Computed in float32."""
    q, means = q.float(), means.float()
    num_layers, kvh, d = means.shape[0], means.shape[1], means.shape[-1]
    logits = q.reshape(num_layers, kvh, -1, d) @ means.transpose(-1, -2)  # [L', kvh, g, C]
    probs = torch.softmax(logits.flatten(1, 2) / math.sqrt(d), dim=-1)  # [L', nh, C]
    return aggregate_heads(probs, head_agg)


def block_sums(probs: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """[..., R] attention weights over rows whose first ``num_blocks * block_size`` are whole blocks ->
    [..., num_blocks] each block's share."""
    return probs[..., : num_blocks * block_size].unflatten(-1, (num_blocks, block_size)).sum(-1)


def head_block_mass(
    q: Tensor, keys: Tensor, block_size: int, num_blocks: int, visible: Tensor | None = None
) -> Tensor:
    """Each block's share of every query head's attention: q [..., nh, n, d] rotated queries, keys
    [..., kvh, R, d] (leading dims alike, e.g. layers; the softmax runs over all R rows, or the ``visible``
    ones, a bool mask broadcast to [..., kvh, g, n, R]; the blocks are the first ``num_blocks * block_size``
    rows) -> [..., nh, n, num_blocks]. Computed in float32."""
    q, keys = q.float(), keys.float()
    *lead, kvh, total, d = keys.shape
    nh, n = q.shape[-3], q.shape[-2]
    grouped = q.reshape(*lead, kvh, nh // kvh * n, d)  # one matrix product per KV head, not a broadcast one
    logits = (grouped @ keys.transpose(-1, -2)).div_(math.sqrt(d)).reshape(*lead, kvh, nh // kvh, n, total)
    if visible is not None:
        logits.masked_fill_(~visible, -math.inf)  # in place: the product is a fresh tensor
    probs = torch.softmax(logits, dim=-1).reshape(*lead, nh, n, total)
    return block_sums(probs, block_size, num_blocks)


class ScratchBuffers:
    """Named buffers reused from step to step (grown by a quarter when too small). At long contexts a
    fresh buffer for rescore's gathered keys every step cost more in page faults than the work."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous ``shape`` view of buffer ``name`` (contents undefined)."""
        size = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(size + size // 4, dtype=dtype, device=device)
        return buffer[:size].view(shape)


def shortlist_block_mass(
    q: Tensor,
    cache: KVCache,
    layers: tuple[int, ...],
    rows: Tensor,
    attends_new: Tensor,
    block_size: int,
    num_blocks: int,
    buffers: ScratchBuffers,
) -> Tensor:
    """Each shortlisted block's share of every query head's attention over the keys of ``rows``:
    q [L', nh, d] one rotated query per layer of ``layers``; rows [R] cache rows, the ``num_blocks``
    blocks' first (``num_blocks * block_size`` rows) and the new row last, which only the layers flagged
    in ``attends_new`` [L'] (bool) see -> [L', nh, num_blocks]. Exact in float32, as ``head_block_mass``
    over the gathered keys; each layer's keys are gathered, converted and scored in turn in reused
    buffers, so they are scored while still in the CPU's cache."""
    num_layers, (nh, d), kvh, total = len(layers), q.shape[1:], cache.num_kv_heads, rows.numel()
    logits = buffers.take("logits", (num_layers, kvh, nh // kvh, total), torch.float32, rows.device)
    for i, layer in enumerate(layers):
        source = cache.keys(layer)
        keys = buffers.take("keys", (kvh, total, d), source.dtype, rows.device)
        for head in range(kvh):  # a head's rows are contiguous: faster than one strided gather
            torch.index_select(source[head], 0, rows, out=keys[head])
        if keys.dtype != torch.float32:
            keys = buffers.take("keys32", (kvh, total, d), torch.float32, rows.device).copy_(keys)
        torch.matmul(q[i].float().view(kvh, nh // kvh, d), keys.transpose(-1, -2), out=logits[i])
    logits.div_(math.sqrt(d))
    logits[~attends_new, :, :, -1] = -math.inf
    return block_sums(torch.softmax(logits, dim=-1).view(num_layers, nh, total), block_size, num_blocks)


def window_block_scores(q: Tensor, keys: Tensor, block_size: int, num_blocks: int, head_agg: str) -> Tensor:
    """Exact attention of window queries over the prompt, per block: q [nh, n, d] (rotated, the prompt's
    last n tokens), keys [kvh, T, d] (rows in position order, T >= num_blocks * block_size; the queries
    are the last n of them) -> [num_blocks], heads aggregated, mean over the queries. Computed in float32."""
    total, n = keys.shape[1], q.shape[1]
    rows = torch.arange(total, device=keys.device)
    visible = rows.unsqueeze(0) <= (total - n + torch.arange(n, device=keys.device)).unsqueeze(
        1
    )  # causal: [n, T]
    mass = head_block_mass(q, keys, block_size, num_blocks, visible)  # [nh, n, B]
    return aggregate_heads(mass.transpose(0, 1), head_agg).mean(dim=0)  # [n, nh, B] -> [n, B] -> [B]


def spread_successors(scores: Tensor, share: float) -> Tensor:
    """[C] scores of consecutive candidate blocks, each lifted to at least ``share`` x its predecessor's
    (0: unchanged). A needle or number cut by a block boundary continues in the next block, which the
    probes, looking at where the answer starts, rank low."""
    if not share or scores.numel() < 2:
        return scores
    out = scores.clone()
    out[1:] = torch.maximum(scores[1:], share * scores[:-1])
    return out


@dataclass
class ProbePolicy(SparsePolicy):
    """The question's and the latest queries against the blocks (see the module docstring).

    head_agg: "max" or "mass" over a layer's query heads.
    prompt_share: share of the budget chosen by the question probe (0: the step probe only).
    window: question tokens (the prompt's last ones) whose queries form the question probe.
    groups: contiguous groups of selecting layers, each with its own selection (1: one per step, before
        layer 0, from the previous step's queries; more: each group chooses at its first layer, with that
        layer's current query and the previous step's queries of its other layers).
    split_at: layers where a new layer group starts (before ``groups`` splits each group evenly): with
        ``split_at=(11,)`` layers 0-10 share one choice and layers 11 and up another, chosen as layer 11
        attends, scored with layer 11's query of this step and the previous step's queries of layers
        12 and up. A layer that does not select starts its group at the next selecting layer; a layer the
        model does not have is refused when decoding starts.
    chunk_keep: 0 scores every candidate block; k > 0 first scores chunks of CHUNK_BLOCKS blocks (their
        write-time mean keys) and then only the blocks of the best ``k x budget / CHUNK_BLOCKS`` chunks.
    successors: a block's score is at least this share of its predecessor's (0: off): text is read
        forward, so the block after one that is attended is likely next (a number split by a boundary,
        copied only up to the boundary, e.g. "475948" of "4759486"). It helped on RULER's dev split but
        not on its test split: not a default (``semkv bench sparse --suite ruler``).
    exact_layers: layers that choose alone, with their own current query, before they attend; the other
        selecting layers form contiguous runs between them (each split as ``groups`` splits the layers),
        each run choosing at its first layer. Layers that do not select (dense or window layers) are
        ignored; a layer the model does not have is refused when decoding starts. SmolLM2's layers 3-10
        given their own selection did not recover the probe's loss on RULER's test split: no default.
    exact_keys: score ``exact_layers`` by their current query's exact attention over every cached key
        (per block, heads aggregated by ``head_agg``) instead of the blocks' mean keys: the per-layer
        oracle for those layers, at the cost of one attention score row per layer. With every layer exact
        the loss to dense mostly disappears on RULER, so one mean key per block as the estimate is what
        loses, not the budget.
    rescore: 0 (off), or >= 1: the step scores shortlist the best ``ceil(rescore x budget)`` candidates
        besides the question's reserved ones; the budget is then filled from the shortlist by the exact
        attention of the same queries over the shortlisted blocks' keys, the sink and the window (per
        layer, per head the share of each block, heads aggregated by ``head_agg``, layers averaged). A
        block whose mean key is unremarkable but that holds one key the query aligns with (a needle) is
        ranked by that key. Layers scored with ``exact_keys`` are exact already and skip it. The keys
        are gathered, converted and scored one layer at a time in buffers kept across steps
        (``shortlist_block_mass``). Not a default: on RULER it closes most of the probe's quality gap to
        dense, but at about dense's speed, not faster (docs/benchmarks.md, "Sparse decode").
    rescore_stride: rescore with every ``rescore_stride``-th layer of a group (its first, the one whose query
        is this step's, always): the exact scores read the shortlist's keys of those layers only. Strides
        of 2 and 4 were faster but lost RULER points against every layer, so the default is 1.
    keep_steps: steps a selected block stays resident after it was last selected.
    """

    name = "probe"
    needs_prefill_queries = True  # the question probe and the first step's probe
    head_agg: str = "max"
    prompt_share: float = 0.5
    window: int = 16
    groups: int = 1
    split_at: tuple[int, ...] = ()
    chunk_keep: float = 0.0
    successors: float = 0.0
    exact_layers: tuple[int, ...] = ()
    exact_keys: bool = False
    rescore: float = 0.0
    rescore_stride: int = 1
    keep_steps: int = 4
    _queries: dict[int, Tensor] = field(default_factory=dict, repr=False)
    _question: dict[int, Tensor] = field(default_factory=dict, repr=False)  # layer -> [prompt blocks]
    _last_selected: list[Tensor] = field(default_factory=list, repr=False)
    _num_blocks: int = field(default=0, repr=False)
    _num_groups: int = field(default=1, repr=False)
    _reserved: dict[tuple[int, ...], tuple[tuple[int, int, int], tuple[Tensor, Tensor]]] = field(
        default_factory=dict, repr=False
    )  # per layer group: (candidate range, reserved), the question's top candidates
    _buffers: ScratchBuffers = field(default_factory=ScratchBuffers, repr=False)  # rescore's scratch

    def __post_init__(self) -> None:
        if self.head_agg not in HEAD_AGGREGATES:
            raise ValueError(f"head_agg must be one of {HEAD_AGGREGATES}, got {self.head_agg!r}")
        if not 0.0 <= self.prompt_share <= 1.0:
            raise ValueError(f"prompt_share must be in [0, 1], got {self.prompt_share}")
        if self.window < 1 or self.groups < 1:
            raise ValueError(f"window and groups must be >= 1, got {self.window} and {self.groups}")
        if self.keep_steps < 0 or self.chunk_keep < 0 or not 0.0 <= self.successors <= 1.0:
            raise ValueError("keep_steps and chunk_keep must be >= 0, successors in [0, 1]")
        layers = tuple(self.exact_layers) if isinstance(self.exact_layers, (tuple, list)) else None
        if (
            layers is None
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
            or len(set(layers)) != len(layers)
        ):
            raise ValueError(f"exact_layers must be distinct layer indices >= 0, got {self.exact_layers!r}")
        self.exact_layers = tuple(sorted(layers))
        splits = tuple(self.split_at) if isinstance(self.split_at, (tuple, list)) else None
        if (
            splits is None
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in splits)
            or len(set(splits)) != len(splits)
        ):
            raise ValueError(f"split_at must be distinct layer indices >= 1, got {self.split_at!r}")
        self.split_at = tuple(sorted(splits))
        if self.exact_keys and not self.exact_layers:
            raise ValueError("exact_keys needs exact_layers (the layers it scores with every key)")
        if (
            isinstance(self.rescore, bool)
            or not isinstance(self.rescore, (int, float))
            or not math.isfinite(self.rescore)
            or not (self.rescore == 0 or self.rescore >= 1)
        ):
            raise ValueError(
                f"rescore must be 0 (off) or a finite number >= 1 (a shortlist of rescore x budget blocks), "
                f"got {self.rescore!r}"
            )
        if (
            isinstance(self.rescore_stride, bool)
            or not isinstance(self.rescore_stride, int)
            or self.rescore_stride < 1
        ):
            raise ValueError(f"rescore_stride must be an integer >= 1, got {self.rescore_stride!r}")

    def layer_groups(self, selecting: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The selecting layers cut at ``split_at``, each part in ``groups`` even contiguous groups, each
        split around ``exact_layers`` (each one its own group): with exact layers (3, 4) of 6 selecting
        layers, ((0, 1, 2), (3,), (4,), (5,)); with ``split_at=(2,)`` and no exact layers, ((0, 1),
        (2, 3, 4, 5))."""
        parts: list[tuple[int, ...]] = []
        for low, high in zip((0, *self.split_at), (*self.split_at, None), strict=True):
            part = tuple(layer for layer in selecting if layer >= low and (high is None or layer < high))
            if part:
                parts.append(part)
        out: list[tuple[int, ...]] = []
        for part in parts:
            out += self._split_part(part)
        return tuple(out)

    def _split_part(self, selecting: tuple[int, ...]) -> list[tuple[int, ...]]:
        """``groups`` even contiguous groups of ``selecting``, each split around ``exact_layers``."""
        count = max(1, min(self.groups, len(selecting)))
        bounds = [round(i * len(selecting) / count) for i in range(count + 1)]
        out: list[tuple[int, ...]] = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            run: list[int] = []
            for layer in selecting[a:b]:
                if layer in self.exact_layers:
                    out += [tuple(run), (layer,)] if run else [(layer,)]
                    run = []
                else:
                    run.append(layer)
            if run:
                out.append(tuple(run))
        return out

    def prepare(self, view: StepView) -> None:
        """The first step's probe (the prompt's last token's queries) and the question's block scores."""
        if view.prefill is None or not view.prefill.q:
            raise ValueError("probe needs the prompt's queries captured at prefill")
        for name, layers in (("exact_layers", self.exact_layers), ("split_at", self.split_at)):
            beyond = [i for i in layers if i >= view.cache.num_layers]
            if beyond:
                raise ValueError(f"{name} {beyond} are not layers of a {view.cache.num_layers}-layer model")
        self._num_groups = len(self.layer_groups(view.selecting)) if view.selecting else 1
        self._queries = {layer: view.prefill.q[layer][:, -1] for layer in view.selecting}
        self._last_selected = []
        self._reserved = {}
        self._question = self._question_scores(view) if self.prompt_share > 0 else {}

    def _question_scores(self, view: StepView) -> dict[int, Tensor]:
        """Per selecting layer, [prompt blocks] the question queries' block attention."""
        prefill = view.prefill
        assert prefill is not None
        num_blocks = view.index.num_complete
        rows = prefill.last_position() + 1
        scores = {}
        for layer in view.selecting:
            tail = prefill.positions[layer][-self.window :]
            if int(tail[0]) != rows - tail.numel() or int(tail[-1]) != rows - 1:
                continue  # this layer's captured rows are not the prompt's last ones (selective recompute)
            q = prefill.q[layer][:, -tail.numel() :]
            keys = view.cache.keys(layer)[:, :rows]
            scores[layer] = window_block_scores(q, keys, view.index.block_size, num_blocks, self.head_agg)
        return scores

    def see_query(self, layer: int, q_rot: Tensor) -> None:
        self._queries[layer] = q_rot[:, 0]

    def score(self, view: StepView) -> Tensor:
        layers = view.group or view.selecting or tuple(sorted(self._queries))
        queries = dict(self._queries)
        if view.layer is not None and view.q_rot is not None:
            queries[view.layer] = view.q_rot[:, 0]  # the group's first layer: this step's own query
        if self.exact_keys and view.layer in self.exact_layers and view.q_rot is not None:
            step = self._spread(self._exact_scores(view, view.layer, view.q_rot))
            scores = self._with_question(view, layers, step)
        else:
            q = torch.stack([queries[layer] for layer in layers])  # [L', nh, d]
            step = self._spread(self._step_scores(view, layers, q))
            scores = self._with_question(view, layers, step)
            if self.rescore:
                current = view.layer if view.q_rot is not None else None
                scores = self._rescored(view, layers, q, current, scores)
        self._remember(view, scores)
        return scores

    def _step_scores(self, view: StepView, layers: tuple[int, ...], q: Tensor) -> Tensor:
        """[C] the step probe's scores of the candidates (every block, or chunks first)."""
        span = view.candidate_span()
        pages = layer_rows(view.index.summary("rmean"), layers)  # [L', kvh, nb, d], a view when possible
        if not self.chunk_keep:
            return mean_key_scores(q, pages[:, :, span], self.head_agg).mean(dim=0)
        first, last = span.start // CHUNK_BLOCKS, (span.stop - 1) // CHUNK_BLOCKS + 1
        chunks = layer_rows(view.index.chunk_means(), layers)[:, :, first:last]
        chunk_scores = mean_key_scores(q, chunks, self.head_agg).mean(dim=0)
        keep = min(chunk_scores.numel(), math.ceil(self.chunk_keep * view.budget / CHUNK_BLOCKS))
        kept = torch.topk(chunk_scores, keep).indices + first
        blocks = (kept.unsqueeze(1) * CHUNK_BLOCKS + torch.arange(CHUNK_BLOCKS, device=kept.device)).reshape(
            -1
        )
        blocks = blocks[(blocks >= span.start) & (blocks < span.stop)]
        out = torch.full(
            (span.stop - span.start,), -1.0, device=q.device
        )  # below any probed block, still selectable
        out[blocks - span.start] = mean_key_scores(q, pages[:, :, blocks], self.head_agg).mean(dim=0)
        return out

    def _exact_scores(self, view: StepView, layer: int, q_rot: Tensor) -> Tensor:
        """[C] the candidates' share of ``layer``'s attention (its current query q_rot [nh, 1, d] over every
        cached key, the new row's included), heads aggregated by ``head_agg``."""
        span = view.candidate_span()
        keys = view.cache.keys(layer)
        mass = window_block_scores(q_rot, keys, view.index.block_size, view.index.num_complete, self.head_agg)
        return mass[span]

    def _rescored(
        self, view: StepView, layers: tuple[int, ...], q: Tensor, current: int | None, scores: Tensor
    ) -> Tensor:
        """[C] the question's reserved candidates as ``scores`` has them, the next ``ceil(rescore x budget)``
        by their exact share of the queries' attention, -1 for the rest. q [L', nh, d]: one query per layer
        of ``layers``, layer ``current``'s this step's, the others the previous step's. The rows read: the
        shortlisted blocks' keys, the sink and the window (the new row only for this step's query, the one
        that attends to it); per layer and head each block's share, heads aggregated by ``head_agg``, layers
        averaged."""
        reserved = scores >= QUESTION_LIFT
        size = min(scores.numel(), int(reserved.sum()) + math.ceil(self.rescore * view.budget))
        short = torch.topk(scores, size).indices  # candidate offsets: the reserved ones first
        bs, span, length = view.index.block_size, view.candidate_span(), view.cache.length
        device = view.cache.device
        rows = torch.cat(
            [
                ((short.to(device) + span.start).unsqueeze(1) * bs + torch.arange(bs, device=device)).reshape(
                    -1
                ),
                torch.arange(span.start * bs, device=device),  # the sink
                torch.arange(span.stop * bs, length, device=device),  # the window, the new row last
            ]
        )
        picked = layers[:: self.rescore_stride]
        attends_new = torch.tensor([layer == current for layer in picked], device=device)
        q = q[:: self.rescore_stride]
        mass = shortlist_block_mass(q, view.cache, picked, rows, attends_new, bs, size, self._buffers)
        out = torch.full_like(scores, -1.0)  # below every shortlisted block
        out[short] = aggregate_heads(mass, self.head_agg).mean(dim=0)
        out = self._spread(out)
        out[reserved] = scores[reserved]
        return out

    def _spread(self, scores: Tensor) -> Tensor:
        return spread_successors(scores, self.successors)

    def _with_question(self, view: StepView, layers: tuple[int, ...], step: Tensor) -> Tensor:
        """The question's top ``prompt_share`` of the budget first (scores lifted above every step
        score), then the step probe's order for the rest."""
        reserved = int(round(self.prompt_share * view.budget))
        if reserved <= 0 or not any(layer in self._question for layer in layers):
            return step
        span = view.candidate_span()
        key = (span.start, span.stop, reserved)
        entry = self._reserved.get(layers)
        if entry is None or entry[0] != key:  # the question's scores never change: once per candidate range
            entry = self._reserved[layers] = (key, self._question_top(view, layers, step, reserved))
        top, lift = entry[1]
        lifted = step.clone()
        lifted[top] = lift  # step scores are <= 1
        return lifted

    def _question_top(
        self, view: StepView, layers: tuple[int, ...], step: Tensor, reserved: int
    ) -> tuple[Tensor, Tensor]:
        """(the question's top ``reserved`` candidates [k] as candidate offsets, their lifted scores [k])."""
        prompt = torch.stack([self._question[layer] for layer in layers if layer in self._question]).mean(
            dim=0
        )
        known = view.candidates < prompt.numel()
        question = torch.zeros_like(step)
        question[known] = prompt[view.candidates[known]]
        question = self._spread(question)
        top = torch.topk(question, min(reserved, question.numel())).indices
        return top, QUESTION_LIFT + question[top]

    def _remember(self, view: StepView, scores: Tensor) -> None:
        """Keep this step's choice (the decoder's top-k of the same scores) for residency."""
        self._num_blocks = view.index.num_complete
        if self.keep_steps:
            top = view.candidates[torch.topk(scores, min(view.budget, scores.numel())).indices]
            limit = self.keep_steps * self._num_groups
            self._last_selected = ([top] + self._last_selected)[:limit]

    def resident_hint(self) -> Tensor | None:
        if not self._last_selected or self._num_blocks == 0:
            return None
        hint = torch.full((self._num_blocks,), -1.0, device=self._last_selected[0].device)
        for age, selected in enumerate(reversed(self._last_selected)):
            hint[selected[selected < self._num_blocks]] = float(age + 1)
        return hint
