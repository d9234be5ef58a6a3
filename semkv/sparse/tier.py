"""The fast tier: resident copies of selected blocks plus the hot rows; the live cache is the slow tier.

On a GPU the fast tier is device memory and the slow tier host memory; here both are
host memory, but the movement is real: a block is *copied* from the slow tier into a
fast-tier slot when it is selected and not resident, attention reads only the fast
tier, and evicted slots are reused. Bytes moved are counted at the KV dtype at rest
(pre-RoPE K + V, what a device would receive); the CPU copy holds the rotated keys and
values in the compute dtype so no RoPE is redone per step.

Layout per layer: ``[slots * block_size rows | hot rows]``, one contiguous buffer.
Attention reads the whole used region as is — no gather copy per step. Rows that
must not be seen this step (free slots, resident-but-unselected blocks, unused hot
rows) get a position far in the future, so the causal mask built from positions
hides them. The hot rows are the sink block(s), copied once, and the local window,
refreshed every layer (it holds the new token).

Slot maps come in ``groups`` of layers that share one selection: one group of every reading
layer (policies that choose once per step), one per layer (per-layer policies), or anything
between (a policy's layer groups).
"""

from __future__ import annotations

import torch
from torch import Tensor

from semkv.models.cache import KVCache

HIDDEN = 2**62  # position of rows attention must not see (later than any query)


class FastTier:
    """k, v [L, kvh, slots * block_size + hot_rows, d]; positions [groups, same rows]."""

    def __init__(
        self,
        cache: KVCache,
        block_size: int,
        slots: int,
        hot_rows: int,
        groups: list[list[int]] | None = None,
    ) -> None:
        """``groups``: the layers that read the tier, in groups sharing a slot map (default: one group of
        every layer); blocks are copied for these layers only."""
        if slots < 1:
            raise ValueError(f"the fast tier needs at least one slot, got {slots}")
        self.block_size = block_size
        self.slots = slots
        self.slot_rows = slots * block_size
        self.hot_rows = hot_rows
        self.num_layers = cache.num_layers
        self.layer_groups = (
            [list(g) for g in groups] if groups is not None else [list(range(cache.num_layers))]
        )
        self.layers = [layer for g in self.layer_groups for layer in g]
        self.group_of = {layer: i for i, g in enumerate(self.layer_groups) for layer in g}
        self.groups = len(self.layer_groups)
        shape = (cache.num_layers, cache.num_kv_heads, self.slot_rows + hot_rows, cache.head_dim)
        self.k = torch.zeros(shape, dtype=cache.compute_dtype)
        self.v = torch.zeros(shape, dtype=cache.compute_dtype)
        self.positions = torch.full((self.groups, self.slot_rows + hot_rows), HIDDEN, dtype=torch.long)
        max_blocks = cache.capacity // block_size + 1
        self.slot_of = torch.full((self.groups, max_blocks), -1, dtype=torch.long)
        self.block_in = torch.full((self.groups, slots), -1, dtype=torch.long)
        self._offsets = torch.arange(block_size)
        elem = torch.empty((), dtype=cache.kv_dtype).element_size()
        self.layer_block_bytes = 2 * cache.num_kv_heads * block_size * cache.head_dim * elem
        self.sink_rows = 0
        self.used_hot = 0

    def _layers(self, group: int) -> list[int]:
        return self.layer_groups[group]

    def _grow(self, blocks: int) -> None:
        if blocks <= self.slot_of.shape[1]:
            return
        grown = torch.full((self.groups, 2 * blocks), -1, dtype=torch.long)
        grown[:, : self.slot_of.shape[1]] = self.slot_of
        self.slot_of = grown

    def block_rows(self, blocks: Tensor) -> Tensor:
        """Row indices [n * block_size] of ``blocks`` (in a cache or, for slots, in the tier)."""
        return (blocks.unsqueeze(1) * self.block_size + self._offsets).reshape(-1)

    # -- blocks ------------------------------------------------------------------------------------
    def ensure(self, group: int, selected: Tensor, cache: KVCache, extra: Tensor | None = None) -> int:
        """Make ``selected`` resident and the only visible slots; keep ``extra`` blocks (priority
        order) in the room left; evict every other block. Returns (layer, block) copies made."""
        if selected.numel() > self.slots:
            raise RuntimeError(f"{selected.numel()} blocks selected but the fast tier has {self.slots} slots")
        if selected.numel():
            self._grow(int(selected.max()) + 1)
        slot_of, block_in = self.slot_of[group], self.block_in[group]
        held = slot_of[selected]
        keep = torch.zeros(self.slots, dtype=torch.bool)
        keep[held[held >= 0]] = True
        if extra is not None and extra.numel():
            extra = extra[extra < slot_of.numel()]
            extra_slots = slot_of[extra]
            extra_slots = extra_slots[extra_slots >= 0]
            extra_slots = extra_slots[~keep[extra_slots]][: self.slots - selected.numel()]
            keep[extra_slots] = True
        drop = ~keep & (block_in >= 0)
        slot_of[block_in[drop]] = -1
        block_in[drop] = -1
        missing = selected[held < 0]
        copies = 0
        if missing.numel():
            free = (~keep).nonzero().squeeze(1)[: missing.numel()]
            slot_of[missing] = free
            block_in[free] = missing
            src, dst = self.block_rows(missing), self.block_rows(free)
            for layer in self._layers(group):
                self.k[layer][:, dst] = cache.k_rot[layer][:, src]
                self.v[layer][:, dst] = cache.v[layer][:, src]
            copies = int(missing.numel()) * len(self._layers(group))
        visible = self.positions[group, : self.slot_rows]
        visible.fill_(HIDDEN)
        visible[self.block_rows(slot_of[selected])] = cache.positions[self.block_rows(selected)]
        return copies

    # -- hot rows ----------------------------------------------------------------------------------
    def set_sink(self, cache: KVCache, rows: int) -> None:
        """Copy the first ``rows`` cache rows (the sink) into the hot region of every layer."""
        if rows > self.hot_rows:
            raise ValueError(f"sink of {rows} rows exceeds the hot region ({self.hot_rows})")
        self.sink_rows = rows
        at = slice(self.slot_rows, self.slot_rows + rows)
        for layer in self.layers:
            self.k[layer][:, at] = cache.k_rot[layer][:, :rows]
            self.v[layer][:, at] = cache.v[layer][:, :rows]
        self.positions[:, at] = cache.positions[:rows]

    def set_window(self, cache: KVCache, start: int) -> None:
        """Declare rows [start, cache.length) the window for this step (positions only)."""
        count = cache.length - start
        if self.sink_rows + count > self.hot_rows:
            raise RuntimeError(f"window of {count} rows does not fit the hot region ({self.hot_rows})")
        begin = self.slot_rows + self.sink_rows
        self.positions[:, begin : begin + count] = cache.positions[start : cache.length]
        self.positions[:, begin + count :] = HIDDEN
        self.used_hot = self.sink_rows + count
        self._window_start = start

    def view(self, layer: int, cache: KVCache) -> tuple[Tensor, Tensor, Tensor]:
        """Copy ``layer``'s window rows in, and return (keys, values, positions) of the used region."""
        begin = self.slot_rows + self.sink_rows
        count = self.used_hot - self.sink_rows
        rows = slice(self._window_start, self._window_start + count)
        self.k[layer][:, begin : begin + count] = cache.k_rot[layer][:, rows]
        self.v[layer][:, begin : begin + count] = cache.v[layer][:, rows]
        end = self.slot_rows + self.used_hot
        group = self.group_of[layer]
        return self.k[layer][:, :end], self.v[layer][:, :end], self.positions[group, :end]

    def visible_blocks(self, group: int) -> Tensor:
        """Blocks visible to attention in ``group`` (resident and selected), by slot order."""
        rows = self.positions[group, : self.slot_rows].view(self.slots, self.block_size)[:, 0]
        return self.block_in[group][rows != HIDDEN]

    def resident_layer_blocks(self) -> int:
        """Resident (layer, block) pairs."""
        per_group = (self.block_in >= 0).sum(dim=1)
        return sum(int(n) * len(g) for n, g in zip(per_group, self.layer_groups, strict=True))
