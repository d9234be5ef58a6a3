"""The fast tier: resident copies of selected blocks plus the hot rows; the live cache is the slow tier.

On a GPU the fast tier is device memory and the slow tier host memory; here both are
host memory, but the movement is real: a block is *copied* from the slow tier into a
fast-tier slot when it is selected and not resident, attention reads only the fast
tier, and evicted slots are reused. Bytes moved are counted at the KV dtype at rest
(pre-RoPE K + V, what a device would receive); the CPU copy holds the rotated keys and
values in the compute dtype so no RoPE is redone per step.

Layout per layer: ``[slots * block_size rows | hot rows]``, one contiguous buffer.
Attention reads the whole buffer as is — no gather copy per step. Rows that
must not be seen this step (free slots, resident-but-unselected blocks, unused hot
rows) get a position far in the future, and :meth:`FastTier.view` hands the runtime the
additive mask that hides them, built once per step and group (not per layer). The hot rows
are the sink block(s), copied once, and the local window, whose rows are copied into each
layer once (the new token's row at its step; the whole window when it moves on by a block).

Slot maps come in ``groups`` of layers that share one selection: one group of every reading
layer (policies that choose once per step), one per layer (per-layer policies), or anything
between (a policy's layer groups). The slot maps are Python lists: a step touches a few dozen
blocks, fewer operations than tensor bookkeeping.
"""

from __future__ import annotations

import torch
from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.runtime import GatheredRows

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
        device = cache.device
        self.k = torch.zeros(shape, dtype=cache.compute_dtype, device=device)
        self.v = torch.zeros(shape, dtype=cache.compute_dtype, device=device)
        self.positions = torch.full(
            (self.groups, self.slot_rows + hot_rows), HIDDEN, dtype=torch.long, device=device
        )
        self.block_in: list[list[int]] = [[-1] * slots for _ in self.layer_groups]  # per slot, -1: free
        self.slot_of: list[dict[int, int]] = [{} for _ in self.layer_groups]
        self._offsets = torch.arange(block_size, device=device)
        elem = cache.kv_dtype.itemsize
        self.layer_block_bytes = 2 * cache.num_kv_heads * block_size * cache.head_dim * elem
        self.sink_rows = 0
        self.used_hot = 0
        self._window_start = 0
        self._bias: list[tuple[Tensor | None] | None] = [None] * self.groups  # per group, this step's mask
        self._visible: list[list[int]] = [[] for _ in self.layer_groups]  # per group, the visible blocks
        # per layer: ((window start, sink rows), end) of the window rows its buffer holds
        self._copied: list[tuple[tuple[int, int], int]] = [((-1, -1), 0)] * cache.num_layers

    def block_rows(self, blocks: Tensor) -> Tensor:
        """Row indices [n * block_size] of ``blocks`` (in a cache or, for slots, in the tier)."""
        return (blocks.unsqueeze(1) * self.block_size + self._offsets).reshape(-1)

    def resident(self, group: int) -> list[int]:
        """Blocks resident in ``group``'s slots, in slot order."""
        return [block for block in self.block_in[group] if block >= 0]

    # -- blocks ------------------------------------------------------------------------------------
    def ensure(self, group: int, selected: list[int], cache: KVCache, extra: Tensor | None = None) -> int:
        """Make ``selected`` (ascending block ids) resident and the only visible slots; keep ``extra``
        blocks (priority order) in the room left; evict every other block. Missing blocks go to the
        lowest free slots, in ``selected``'s order. Returns (layer, block) copies made."""
        if len(selected) > self.slots:
            raise RuntimeError(f"{len(selected)} blocks selected but the fast tier has {self.slots} slots")
        slot_of, block_in = self.slot_of[group], self.block_in[group]
        wanted = set(selected)
        keep = {slot_of[b] for b in selected if b in slot_of}
        room = self.slots - len(selected)
        if extra is not None and room > 0:
            for block in extra.tolist():
                slot = slot_of.get(block)
                if slot is not None and block not in wanted and slot not in keep:
                    keep.add(slot)
                    room -= 1
                    if room == 0:
                        break
        for slot, block in enumerate(block_in):
            if block >= 0 and slot not in keep:
                del slot_of[block]
                block_in[slot] = -1
        missing = [b for b in selected if b not in slot_of]
        free = [slot for slot, block in enumerate(block_in) if block < 0][: len(missing)]
        for block, slot in zip(missing, free, strict=True):
            slot_of[block] = slot
            block_in[slot] = block
        copies = 0
        if missing:
            src = self.block_rows(torch.tensor(missing, dtype=torch.long, device=self.k.device))
            dst = self.block_rows(torch.tensor(free, dtype=torch.long, device=self.k.device))
            for layer in self.layer_groups[group]:
                self.k[layer].index_copy_(1, dst, cache.k_rot[layer].index_select(1, src))
                self.v[layer].index_copy_(1, dst, cache.v[layer].index_select(1, src))
            copies = len(missing) * len(self.layer_groups[group])
        if missing or selected != self._visible[group]:  # else the same slots stay visible
            self._show(group, selected, cache)
        return copies

    def _show(self, group: int, selected: list[int], cache: KVCache) -> None:
        """Make the slots of ``selected`` (resident) the only visible ones of ``group``."""
        visible = self.positions[group, : self.slot_rows]
        visible.fill_(HIDDEN)
        if selected:
            device = visible.device
            chosen = torch.tensor(selected, dtype=torch.long, device=device)
            slots = torch.tensor([self.slot_of[group][b] for b in selected], dtype=torch.long, device=device)
            blocks = cache.positions.narrow(0, 0, (max(selected) + 1) * self.block_size)
            visible.view(self.slots, self.block_size)[slots] = blocks.view(-1, self.block_size)[chosen]
        self._visible[group] = list(selected)
        self._bias[group] = None

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
        self._bias = [None] * self.groups

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
        self._bias = [None] * self.groups

    def view(self, layer: int, cache: KVCache, mask_known: bool = True) -> GatheredRows:
        """Copy ``layer``'s window rows in (those this layer's buffer does not hold yet: the rows of the
        cache never change once written), and return the keys, values and positions of the used region,
        with the mask of the hidden rows when ``mask_known`` (the caller knows every cache row precedes
        the new token, so exactly the hidden rows are masked). The rows are the layer's whole buffer, the
        unused hot rows hidden like the others: a contiguous [kvh, rows, d] operand, which torch's CPU
        batched matmul reads as it is, where a leading slice of it is copied first (two copies per layer
        and step)."""
        begin = self.slot_rows + self.sink_rows
        start, end = self._window_start, self._window_start + self.used_hot - self.sink_rows
        have = self._copied[layer]
        fresh = have[1] if have[0] == (start, self.sink_rows) and have[1] <= end else start
        if fresh < end:
            at, count = begin + fresh - start, end - fresh
            self.k[layer].narrow(1, at, count).copy_(cache.k_rot[layer].narrow(1, fresh, count))
            self.v[layer].narrow(1, at, count).copy_(cache.v[layer].narrow(1, fresh, count))
            self._copied[layer] = ((start, self.sink_rows), end)
        group = self.group_of[layer]
        positions = self.positions[group]
        bias = self._mask(group, positions, cache.compute_dtype) if mask_known else None
        return GatheredRows(self.k[layer], self.v[layer], positions, bias, mask_known)

    def _mask(self, group: int, positions: Tensor, dtype: torch.dtype) -> Tensor | None:
        """Additive mask [1, R] of ``group``'s hidden rows (None: none hidden), once per step and group."""
        cached = self._bias[group]
        if cached is None:
            hidden = (positions == HIDDEN).unsqueeze(0)
            bias = None
            if bool(hidden.any()):
                bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
                    hidden, float("-inf")
                )
            cached = self._bias[group] = (bias,)
        return cached[0]

    def visible_blocks(self, group: int) -> list[int]:
        """Blocks visible to attention in ``group`` (resident and selected), by slot order."""
        rows = self.positions[group, : self.slot_rows].view(self.slots, self.block_size)[:, 0]
        return [b for b, seen in zip(self.block_in[group], (rows != HIDDEN).tolist(), strict=True) if seen]

    def resident_layer_blocks(self) -> int:
        """Resident (layer, block) pairs."""
        return sum(len(self.slot_of[g]) * len(layers) for g, layers in enumerate(self.layer_groups))
