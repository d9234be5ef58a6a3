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
through the cache's query observer while the prompt is prefilled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.models.cache import KVCache


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
    """Rotated queries of some prompt tokens, per layer, as the runtime computed them.

    q: layer -> [nh, n_l, d] rotated queries (after every norm the family applies, e.g. Gemma 3's
    q_norm); positions: layer -> [n_l] their absolute positions (ascending). Full and prefix prefill
    capture the same rows at every layer; a selective recompute (blend, share) computes fewer rows
    at later layers, so a layer holds the captured rows it computed. window: how many of them (the
    last ones) are the observation window.
    """

    q: dict[int, Tensor] = field(default_factory=dict)
    positions: dict[int, Tensor] = field(default_factory=dict)
    window: int = 0

    def window_queries(self, layer: int) -> Tensor:
        """[nh, window, d] the last ``window`` prompt tokens' queries (SnapKV's observation window)."""
        return self.q[layer][:, -self.window :]

    def last_position(self) -> int:
        """The largest captured prompt position (the prompt's last token)."""
        return max(int(p[-1]) for p in self.positions.values())


def captured_offsets(total: int, window: int, stride: int) -> Tensor:
    """Offsets (ascending) into ``total`` computed rows: every ``stride``-th from the end + the last ``window``."""
    ends = torch.arange(total - 1, -1, -stride) if stride > 0 else torch.empty(0, dtype=torch.long)
    last = torch.arange(max(0, total - window), total)
    return torch.unique(torch.cat([ends, last]))  # sorted


@contextlib.contextmanager
def capture_prefill_queries(cache: KVCache, window: int = 32, stride: int = 64) -> Iterator[PrefillQueries]:
    """Record the queries of the prefills run on ``cache`` inside the ``with`` block.

    Through the cache's ``query_observer`` (:meth:`semkv.models.runtime.Runtime.forward_rows`): at every
    layer the rotated queries of the computed rows, as the runtime used them. Of each layer's rows the
    last ``window`` and every ``stride``-th from the end are kept; a later prefill replaces an earlier
    one's rows.
    """
    result = PrefillQueries(window=window)

    def record(layer: int, q_rot: Tensor, positions: Tensor) -> None:
        offsets = captured_offsets(positions.shape[0], window, stride)
        result.q[layer] = q_rot[:, offsets].detach().clone()
        result.positions[layer] = positions[offsets].clone()

    previous = cache.query_observer
    cache.query_observer = record
    try:
        yield result
    finally:
        cache.query_observer = previous
    if result.positions:
        result.window = min(window, min(p.shape[0] for p in result.positions.values()))
