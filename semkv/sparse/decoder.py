"""The sparse decoder: turns a policy into the runtime's per-layer key gathering.

Every decode step it (1) summarises the block the previous step completed, if any, in
its :class:`BlockIndex` (the prompt's blocks were summarised when the prefill wrote them:
:meth:`SparseDecoder.attach`), (2) splits the cache into the always-kept *hot* rows — the sink block(s) and the
local window, which includes the new token — and the *candidate* blocks between
them, (3) asks the policy for scores (once per step, or per layer with that layer's
query) and keeps the budget's top blocks — or, on the steps between choices
(``SparseConfig.reselect_every``), keeps the last choice — (4) makes them resident in the
:class:`FastTier` (copying what is missing from the slow tier, evicting what is
neither selected nor worth keeping by the policy's residency hint) and (5) hands the
runtime the keys, values and positions of hot rows + selected blocks, with the mask of
the tier's hidden rows built once per step (not per layer).

If the budget covers every candidate the step is dense: the runtime attends to
every row exactly as without a selector. Sliding-window layers (``layer_windows``) never
select: they attend to the rows of their window, a slice of the cache (what their mask
leaves visible), whatever the budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.runtime import GatheredRows
from semkv.sparse.base import Budget, SparsePolicy, StepRecord, StepView, topk_blocks
from semkv.sparse.index import BlockIndex, PrefillQueries
from semkv.sparse.tier import HIDDEN, FastTier


@dataclass
class SparseConfig:
    """Budget and always-kept rows, shared by every policy.

    kv_budget: candidate blocks per step, as a fraction of the context (0, 1] or a token count.
    min_kept_tokens: the budget never keeps fewer than this many tokens of candidate blocks (0: no
        floor). It protects short contexts, where a fraction is a handful of blocks: 10% of 1,024 tokens
        is 7 blocks of 16. A budget covering every candidate decodes dense (``dense_when_covered``), so a
        context whose candidate blocks hold at most ``min_kept_tokens`` tokens decodes exactly as dense.
    sink_blocks: leading blocks always attended (the attention sink).
    window_tokens: at least this many latest tokens always attended (rounded out to a block edge).
    resident_factor: fast-tier capacity in multiples of the largest budget (room for the
        residency hint to keep unselected blocks). 1 by default: on CPU a decode step reads the fast
        tier's whole buffer (its unused and hidden slots masked), so spare slots cost reads every step,
        and a factor of 2 was no faster (docs/benchmarks.md). A device tier that copies blocks in from
        host memory may want 2 (cuda: not yet verified by ``semkv bench gpu``).
    record_queries: keep each step's per-layer query (for oracle overlap, measured afterwards).
    dense_when_covered: a budget covering every candidate attends to the cache directly (exact);
        False still goes through the fast tier (tests use it to check the gather path).
    dense_layers: layers that attend to every row (no selection). Empty by default: neither the first
        layers nor the probe's weak middle layers made dense gained beyond noise on RULER
        (docs/history/measurements.md).
    layer_windows: per layer, its sliding window (None: a global layer); window layers attend to the
        rows of their window only, sliced from the cache (the engine fills this from the model).
    reselect_every: score and choose blocks at most every this many steps: the steps between reuse the
        last choice while the candidate blocks and the budget are those it was made from (a block the
        local window leaves, or a budget grown by a block, brings a new choice at once), so neither
        scoring nor copying into the fast tier runs on them. 1: choose every step (the policies' own
        definition). TokenSelect's selection cache reuses a choice while consecutive queries are alike;
        this is a fixed-period form of it. 4 by default, chosen on RULER's dev split: it cuts the
        selection's share of a step several-fold at a quality cost not separated from zero
        (docs/benchmarks.md, "Sparse decode"). A request sets it with
        ``GenerateRequest.sparse_reselect_every``.
    dense_steps: the engine decodes this many steps of a request densely before it sets the decoder up
        (the prompt's block summaries, the policy's preparation): an answer that ends within them pays
        no set-up. 0: set up before the first decode step. A fork's decoder is set up at once.
    """

    kv_budget: float | int = 0.1
    min_kept_tokens: int = 0
    sink_blocks: int = 1
    window_tokens: int = 32
    resident_factor: float = 1.0
    record_queries: bool = False
    dense_when_covered: bool = True
    dense_layers: tuple[int, ...] = ()
    layer_windows: tuple[int | None, ...] = ()
    reselect_every: int = 4
    dense_steps: int = 0
    budget: Budget = field(init=False)

    def __post_init__(self) -> None:
        self.budget = Budget(self.kv_budget, self.min_kept_tokens)
        if self.sink_blocks < 0:
            raise ValueError(f"sink_blocks must be >= 0, got {self.sink_blocks}")
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {self.window_tokens}")
        if self.resident_factor < 1.0:
            raise ValueError(f"resident_factor must be >= 1, got {self.resident_factor}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.dense_layers):
            raise ValueError(f"dense_layers must be layer indices >= 0, got {self.dense_layers!r}")
        self.dense_layers = tuple(self.dense_layers)
        if any(
            w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1)
            for w in self.layer_windows
        ):
            raise ValueError(f"layer_windows must be window sizes >= 1 or None, got {self.layer_windows!r}")
        self.layer_windows = tuple(self.layer_windows)
        if isinstance(self.reselect_every, bool) or not isinstance(self.reselect_every, int):
            raise ValueError(f"reselect_every must be an int >= 1, got {self.reselect_every!r}")
        if self.reselect_every < 1:
            raise ValueError(f"reselect_every must be >= 1, got {self.reselect_every}")
        if (
            isinstance(self.dense_steps, bool)
            or not isinstance(self.dense_steps, int)
            or self.dense_steps < 0
        ):
            raise ValueError(f"dense_steps must be an int >= 0, got {self.dense_steps!r}")


class SparseDecoder:
    """Implements the runtime's key-gathering hook for one sequence (one generation)."""

    def __init__(
        self,
        policy: SparsePolicy,
        config: SparseConfig,
        block_size: int,
        prefill: PrefillQueries | None = None,
    ) -> None:
        self.policy = policy
        self.config = config
        self.block_size = block_size
        self.prefill = prefill
        self.records: list[StepRecord] = []
        self.queries: list[Tensor] = []  # per step: [L, nh, d] (record_queries)
        self.index: BlockIndex | None = None
        self.tier: FastTier | None = None
        self._observes = type(policy).observe is not SparsePolicy.observe
        self._sees_queries = type(policy).see_query is not SparsePolicy.see_query
        self._selecting: tuple[int, ...] = ()
        self._groups: list[tuple[int, ...]] = []
        self._group_of: dict[int, int] = {}
        self._at_step_start = True
        self._reads_queries = True
        self._step = -1
        self._step_state: dict[str, Any] = {}
        # per group: its last choice (step, (candidate span, budget) it was made from, blocks)
        self._chosen: dict[int, tuple[int, tuple[slice, int], Tensor]] = {}
        self.prepare_s = 0.0
        self._ordered = False  # cache rows in position order (window layers may then slice)
        self._all_past = False  # every cache row precedes the decoded ones (the tier's mask is then exact)

    # -- set-up ---------------------------------------------------------------------------------
    def attach(self, index: BlockIndex) -> None:
        """Start on ``index``'s cache, whose written blocks ``index`` already summarises (the engine does
        this right after the prefill, so no decode step builds summaries), and let the policy prepare
        (e.g. pool the prompt's summaries, or SnapKV's prompt attention): timed as ``prepare_s``."""
        if self.policy.needs_prefill_queries and self.prefill is None:
            raise ValueError(f"policy {self.policy.name!r} needs the prompt's queries captured at prefill")
        cache = index.cache
        beyond = [i for i in self.config.dense_layers if i >= cache.num_layers]
        if beyond:
            raise ValueError(f"dense_layers {beyond} are not layers of a {cache.num_layers}-layer model")
        self.index = index
        positions = cache.valid_positions()
        self._ordered = bool((positions[1:] > positions[:-1]).all())
        # decoded rows go after the last row's position: every row precedes them if the last is the latest
        self._all_past = bool(positions.numel() == 0 or positions[-1] == positions.max())
        windows = self.config.layer_windows
        self._selecting = tuple(
            i
            for i in range(cache.num_layers)
            if (i >= len(windows) or windows[i] is None) and i not in self.config.dense_layers
        )
        groups = [tuple(g) for g in self.policy.layer_groups(self._selecting) if g]
        if sorted(layer for g in groups for layer in g) != sorted(self._selecting):
            raise ValueError(
                f"policy {self.policy.name!r}: layer groups {groups} do not cover {self._selecting}"
            )
        self._groups = groups
        self._group_of = {layer: i for i, g in enumerate(groups) for layer in g}
        self._at_step_start = not self.policy.per_layer and len(groups) == 1
        # a once-per-step policy that neither observes nor sees queries never reads a layer's query
        self._reads_queries = (
            not self._at_step_start or self._observes or self._sees_queries or self.config.record_queries
        )
        most = self.config.budget.blocks(cache.capacity, self.block_size)
        slots = max(1, int(most * self.config.resident_factor))
        if not self.policy.is_dense:
            hot = self.config.sink_blocks * self.block_size + self.config.window_tokens + self.block_size
            self.tier = FastTier(cache, self.block_size, slots, hot, [list(g) for g in groups])
        if self.policy.is_dense:
            return
        sink, win_block, _ = self._geometry(cache.length + 1)  # the first step's geometry
        view = StepView(
            cache,
            index,
            torch.arange(sink, win_block, device=cache.device),
            0,
            -1,
            prefill=self.prefill,
            selecting=self._selecting,
        )
        start = time.perf_counter()
        self.policy.prepare(view)
        self.prepare_s = time.perf_counter() - start

    def _geometry(self, length: int) -> tuple[int, int, int]:
        """(sink blocks, first window block, window start row) for a cache of ``length`` rows."""
        bs = self.block_size
        win_block = max(0, (length - self.config.window_tokens) // bs)
        sink = min(self.config.sink_blocks, win_block)
        return sink, win_block, win_block * bs

    # -- the runtime hook -------------------------------------------------------------------------
    def gather(self, layer: int, q_rot: Tensor, cache: KVCache) -> GatheredRows | None:
        """Keys [kvh, R, d], values [kvh, R, d] and positions [R] this layer attends to (the new
        row included), or None for every row. Rows hidden this step carry a far-future position
        and, when every cache row precedes the new token, the mask hiding them comes along
        (``mask_known``). Policies see the query and keys in float32, whatever the compute dtype."""
        if layer == 0:
            self._start_step(cache)
        if self._reads_queries:
            q_rot = q_rot.float()
        if self.config.record_queries:
            self._step_state["queries"].append(q_rot[:, 0].detach().clone())
        window = self.config.layer_windows[layer] if layer < len(self.config.layer_windows) else None
        if window is not None:
            return self._window_rows(layer, cache, window)
        picked = self._selected_rows(layer, q_rot, cache)
        if self._sees_queries and layer in self._group_of:
            self.policy.see_query(layer, q_rot)  # after this layer's selection: it is the next step's probe
        return picked

    def _selected_rows(self, layer: int, q_rot: Tensor, cache: KVCache) -> GatheredRows | None:
        """The attended rows of ``layer`` (choosing its group's blocks first if it leads the group)."""
        state = self._step_state
        if state["dense"] or layer not in self._group_of:
            return None
        assert self.tier is not None
        record = state["record"]
        group = self._group_of[layer]
        if self._at_step_start:
            selected = state["selected"]
        elif layer == self._groups[group][0]:
            selected = self._choose(group, cache, layer, q_rot)
            state["selected"] = selected
            self._place(group, selected, cache)
        else:
            selected = state["selected"]
        start = time.perf_counter()
        picked = self.tier.view(layer, cache, mask_known=self._all_past)
        record.gather_s += time.perf_counter() - start
        if self._observes:
            start = time.perf_counter()
            region_rows = torch.cat(
                [
                    self.tier.block_rows(
                        torch.tensor(self.tier.block_in[group], device=cache.device).clamp(min=0)
                    ),
                    torch.arange(state["sink_rows"], device=cache.device),
                    torch.arange(state["win_row"], cache.length, device=cache.device),
                ]
            )
            used = region_rows.numel()  # the tier's rows past these are unused hot rows
            visible = picked.positions[:used] != HIDDEN
            self.policy.observe(
                self._view(cache, layer, q_rot),
                selected,
                picked.keys[:, :used][:, visible].float(),
                region_rows[visible],
            )
            record.select_s += time.perf_counter() - start
        return picked

    def _place(self, group: int, selected: Tensor, cache: KVCache) -> None:
        """Record ``selected`` (the group's choice this step) and make it resident and visible in the
        fast tier (copying the blocks that are not resident)."""
        assert self.tier is not None
        state = self._step_state
        record = state["record"]
        blocks = selected.tolist()
        record.selected.append(blocks)
        start = time.perf_counter()
        record.loaded_blocks += self.tier.ensure(group, blocks, cache, state["extra"])
        record.gather_s += time.perf_counter() - start

    def _window_rows(self, layer: int, cache: KVCache, window: int) -> GatheredRows | None:
        """The rows a sliding-window layer sees (position within ``window`` of the new row's): a slice of
        the cache when rows are in position order, else None (every row, masked by the runtime)."""
        if not self._ordered:
            return None
        positions = cache.valid_positions()
        first = int(torch.searchsorted(positions, positions[-1] - window + 1))
        rows = slice(first, cache.length)
        return GatheredRows(cache.k_rot[layer][:, rows], cache.v[layer][:, rows], positions[rows])

    def _view(self, cache: KVCache, layer: int | None, q_rot: Tensor | None) -> StepView:
        state = self._step_state
        assert self.index is not None
        group = self._groups[self._group_of[layer]] if layer is not None else self._selecting
        return StepView(
            cache,
            self.index,
            state["candidates"],
            state["budget"],
            self._step,
            layer,
            q_rot,
            self.prefill,
            self._selecting,
            group,
            state["span"],
        )

    def _choose(self, group: int, cache: KVCache, layer: int | None, q_rot: Tensor | None) -> Tensor:
        """The group's blocks this step (ascending block ids): the last choice while it is younger than
        ``reselect_every`` steps and the candidates and budget are the ones it was made from, else a
        new one (a block the window leaves is chosen from at once)."""
        state = self._step_state
        made_from = (state["span"], state["budget"])
        last = self._chosen.get(group)
        if last is not None and self._step - last[0] < self.config.reselect_every and last[1] == made_from:
            return last[2]
        selected = self._select(cache, layer, q_rot)
        self._chosen[group] = (self._step, made_from, selected)
        return selected

    def _select(self, cache: KVCache, layer: int | None, q_rot: Tensor | None) -> Tensor:
        """Score and keep the budget's top candidates (timed as selection)."""
        start = time.perf_counter()
        state = self._step_state
        view = self._view(cache, layer, q_rot)
        scores = self.policy.score(view)
        selected = topk_blocks(scores, state["candidates"], state["budget"])
        if layer is None or layer == self._groups[0][0]:  # once per step
            hint = self.policy.resident_hint()
            if hint is not None:
                order = torch.argsort(hint, descending=True)
                state["extra"] = order[hint[order] >= 0]
        state["record"].select_s += time.perf_counter() - start
        return selected

    def _start_step(self, cache: KVCache) -> None:
        if self.index is None:
            # used without an engine (no attach): summarise the blocks written so far now
            index = BlockIndex(cache, self.block_size)
            index.add_blocks((cache.length - 1) // self.block_size)
            self.attach(index)
        assert self.index is not None
        if self._step >= 0 and self.config.record_queries:
            self.queries.append(torch.stack(self._step_state["queries"]))
        self._step += 1
        # the rows before the new one are written at every layer: summarise a block they completed
        start = time.perf_counter()
        self.index.add_blocks((cache.length - 1) // self.block_size)
        summarise_s = time.perf_counter() - start
        sink, win_block, win_row = self._geometry(cache.length)
        candidates = torch.arange(sink, win_block, device=cache.device)
        budget = self.config.budget.blocks(cache.length, self.block_size)
        record = StepRecord(self._step, cache.length, summarise_s=summarise_s)
        self.records.append(record)
        dense = self.policy.is_dense or (self.config.dense_when_covered and budget >= candidates.numel())
        self._step_state = {
            "candidates": candidates,
            "span": slice(sink, max(sink, win_block)),
            "budget": budget,
            "sink_rows": sink * self.block_size,
            "win_row": win_row,
            "dense": dense,
            "record": record,
            "extra": None,
            "queries": [],
        }
        if dense:
            record.selected.append(candidates.tolist())
            record.resident_blocks = cache.num_layers * candidates.numel()
            return
        assert self.tier is not None
        start = time.perf_counter()
        if self.tier.sink_rows != sink * self.block_size:
            self.tier.set_sink(cache, sink * self.block_size)
        self.tier.set_window(cache, win_row)
        record.gather_s += time.perf_counter() - start
        if self._at_step_start:
            selected = self._choose(0, cache, None, None)
            self._place(0, selected, cache)
            self._step_state["selected"] = selected

    def finish(self) -> None:
        """Close the last step's bookkeeping (call after the last decode step)."""
        if self.config.record_queries and self._step_state.get("queries"):
            self.queries.append(torch.stack(self._step_state["queries"]))
            self._step_state["queries"] = []
        if self.tier is not None and self.records:
            self.records[-1].resident_blocks = self.tier.resident_layer_blocks()

    # -- statistics -----------------------------------------------------------------------------
    def stats(self, decode_s: float | None = None) -> dict[str, Any]:
        """Per-generation figures: blocks selected per step, resident and moved bytes, selection time."""
        recs = self.records
        if not recs:
            return {"sparse_policy": self.policy.name, "sparse_steps": 0}
        layer_block = self.tier.layer_block_bytes if self.tier is not None else 0
        num_layers = len(self.tier.layers) if self.tier is not None else 1
        selected = [sum(len(s) for s in r.selected) / len(r.selected) for r in recs]
        loaded = [r.loaded_blocks / num_layers for r in recs]
        select_s = sum(r.select_s for r in recs)
        out: dict[str, Any] = {
            "sparse_policy": self.policy.name,
            "sparse_steps": len(recs),
            "kv_budget": self.config.kv_budget,
            **(
                {"sparse_min_kept_tokens": self.config.min_kept_tokens} if self.config.min_kept_tokens else {}
            ),
            "sparse_reselect_every": self.config.reselect_every,
            "blocks_selected_per_step": sum(selected) / len(selected),
            "blocks_loaded_first_step": loaded[0],
            "blocks_loaded_per_step": sum(loaded[1:]) / max(1, len(loaded) - 1),
            "bytes_loaded": int(sum(r.loaded_blocks for r in recs) * layer_block),
            "resident_kv_bytes": int(self.tier.resident_layer_blocks() * layer_block) if self.tier else None,
            "hot_rows": recs[-1].context_tokens
            - self._step_state.get("win_row", 0)
            + self._step_state.get("sink_rows", 0),
            "prepare_s": self.prepare_s,
            "decode_summarise_s": sum(r.summarise_s for r in recs),
            "select_s": select_s,
            "gather_s": sum(r.gather_s for r in recs),
        }
        if decode_s:
            out["select_share"] = select_s / decode_s
        return out
