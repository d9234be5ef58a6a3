"""Per-block summaries, kept up to date as blocks are written, and queries captured at prefill.

:class:`BlockIndex` computes what policies read about each *complete* block
(every layer written), once per block, when the block is first needed:

* ``key_means`` [L, kvh, nb, d]: mean pre-RoPE key of the block per layer and KV head
  (Key-Key's raw material, ~B/16 of the block's keys);
* ``key_bounds`` ([L, kvh, nb, d] min, [L, kvh, nb, d] max): per-channel min/max of the
  rotated keys (Quest's bound);
* ``head_variance`` [L, kvh]: variance of each KV head's pre-RoPE keys over the prompt
  (Key-Key's head weights), frozen at the first update.

:class:`PrefillQueries` holds rotated queries of a few prompt tokens per layer
(the last ``window`` tokens plus every ``stride``-th token from the end), captured
with forward hooks on the query projections while the prompt is prefilled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.runtime import Runtime


class BlockIndex:
    """Summaries of the complete blocks of one cache (block = ``block_size`` consecutive rows)."""

    def __init__(self, cache: KVCache, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.cache = cache
        self.block_size = block_size
        self.num_complete = 0
        self._summaries: dict[str, Tensor] = {}  # name -> [L, kvh, max blocks, d] (see _buffer)
        self._have: dict[str, int] = {}  # summary -> blocks computed so far
        self._variance: Tensor | None = None

    def update(self, complete_blocks: int) -> None:
        """Declare blocks [0, complete_blocks) complete (all layers written)."""
        self.num_complete = max(self.num_complete, complete_blocks)

    def _rows(self, tensors: list[Tensor], start_block: int) -> Tensor:
        """[L, kvh, n, bs, d] float32 view-copy of blocks [start_block, num_complete)."""
        bs = self.block_size
        rows = slice(start_block * bs, self.num_complete * bs)
        stacked = torch.stack([t[:, rows] for t in tensors]).float()
        shape = stacked.shape
        return stacked.view(shape[0], shape[1], -1, bs, shape[-1])

    def _buffer(self, name: str, blocks: int) -> Tensor:
        """[L, kvh, >= blocks, d] float32 buffer of summary ``name``. Sized for the cache's capacity and
        grown by doubling if the cache grows (appending by concatenation would copy every block each
        time one completes)."""
        old = self._summaries.get(name)
        if old is None or old.shape[2] < blocks:
            c = self.cache
            size = max(blocks, c.capacity // self.block_size + 1, 2 * old.shape[2] if old is not None else 0)
            buffer = torch.zeros(c.num_layers, c.num_kv_heads, size, c.head_dim)
            if old is not None:
                buffer[:, :, : old.shape[2]] = old
            self._summaries[name] = buffer
        return self._summaries[name]

    def key_means(self) -> Tensor:
        """[L, kvh, nb, d] mean pre-RoPE key per complete block."""
        have, n = self._have.get("means", 0), self.num_complete
        means = self._buffer("means", n)
        if have < n:
            means[:, :, have:n] = self._rows(self.cache.k_pre, have).mean(dim=3)
            self._have["means"] = n
        return means[:, :, :n]

    def key_bounds(self) -> tuple[Tensor, Tensor]:
        """([L, kvh, nb, d] min, [L, kvh, nb, d] max) of rotated keys per complete block."""
        have, n = self._have.get("bounds", 0), self.num_complete
        mins, maxs = self._buffer("mins", n), self._buffer("maxs", n)
        if have < n:
            rows = self._rows(self.cache.k_rot, have)
            mins[:, :, have:n] = rows.amin(dim=3)
            maxs[:, :, have:n] = rows.amax(dim=3)
            self._have["bounds"] = n
        return mins[:, :, :n], maxs[:, :, :n]

    def head_variance(self) -> Tensor:
        """[L, kvh] variance of each KV head's pre-RoPE keys over the complete blocks at first call."""
        if self._variance is None:
            rows = self.num_complete * self.block_size
            if rows == 0:
                raise ValueError("head_variance needs at least one complete block")
            keys = torch.stack([k[:, :rows] for k in self.cache.k_pre]).float()  # [L, kvh, n, d]
            self._variance = keys.var(dim=(2, 3))
        return self._variance


@dataclass
class PrefillQueries:
    """Rotated queries of some prompt tokens, per layer.

    q: layer -> [nh, n, d] rotated queries; positions: [n] their absolute positions
    (ascending); window: how many of them (the last ones) are the observation window.
    """

    q: dict[int, Tensor] = field(default_factory=dict)
    positions: Tensor | None = None
    window: int = 0

    def window_queries(self, layer: int) -> Tensor:
        """[nh, window, d] the last ``window`` prompt tokens' queries (SnapKV's observation window)."""
        return self.q[layer][:, -self.window :]


def captured_offsets(total: int, window: int, stride: int) -> Tensor:
    """Offsets (ascending) into ``total`` computed rows: every ``stride``-th from the end + the last ``window``."""
    ends = torch.arange(total - 1, -1, -stride) if stride > 0 else torch.empty(0, dtype=torch.long)
    last = torch.arange(max(0, total - window), total)
    return torch.unique(torch.cat([ends, last]))  # sorted


@contextlib.contextmanager
def capture_prefill_queries(
    runtime: Runtime, cache: KVCache, window: int = 32, stride: int = 64
) -> Iterator[PrefillQueries]:
    """Record queries of the rows computed by the prefills inside the ``with`` block.

    Hooks the query projection of every layer; the rows of the *last* forward at each
    layer are taken to be the cache's last rows (true for full and prefix prefill).
    The captured queries are rotated to their positions when the block exits.
    """
    adapter = runtime.adapter
    raw: dict[int, Tensor] = {}
    counts: dict[int, int] = {}

    def hook(layer: int):
        def record(_module, _inputs, output: Tensor) -> None:
            offsets = captured_offsets(output.shape[0], window, stride)
            raw[layer] = output[offsets].detach().clone()
            counts[layer] = output.shape[0]

        return record

    handles = [
        adapter.layers[layer].self_attn.q_proj.register_forward_hook(hook(layer))
        for layer in range(adapter.num_layers)
    ]
    result = PrefillQueries(window=window)
    try:
        yield result
    finally:
        for handle in handles:
            handle.remove()
    if not raw:
        return
    total = counts[0]
    offsets = captured_offsets(total, window, stride)
    positions = cache.positions[cache.length - total + offsets]
    result.positions = positions
    result.window = min(window, total)
    for layer, q in raw.items():
        q = q.view(q.shape[0], adapter.num_heads, adapter.head_dim).transpose(0, 1)
        result.q[layer] = runtime.rope(q, positions, layer)
