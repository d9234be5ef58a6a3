"""Reused KV on its way into a live cache, moved in bulk: each stored piece is copied once for a group of
layers into one staging buffer, instead of once per layer (:meth:`semkv.models.runtime.Runtime.load_pieces`).

A blend's prompt is some sixty pieces (its chunks and the one-token separators between them); copied layer by
layer that was 60 x 2 x layers small copies (3,600 on SmolLM2), whose per-call cost was most of the load."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# The most bytes the staging buffer holds (keys and values of a group of layers); a load of more rows per
# layer than fit goes one layer at a time.
LOAD_STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class RowSource:
    """One piece of rows for :meth:`Runtime.load_pieces`: pre-RoPE keys and values [L, kvh, m, d] (any
    device and float dtype), or neither: ``rows`` rows a forward fills (:meth:`empty`).

    order: None (the piece's rows are k / v's m rows as they are) or int64 [n] on the host, the row of
    k / v each of the piece's n rows takes (-1: a zero row), gathered for a group of layers at a time
    into the loader's staging buffer (:meth:`gathered`, :meth:`LoadStaging.stage`): no rearranged copy of
    every layer first."""

    k: Tensor | None
    v: Tensor | None
    count: int = -1
    order: Tensor | None = None

    @property
    def rows(self) -> int:
        if self.order is not None:
            return int(self.order.numel())
        return self.count if self.k is None else self.k.shape[2]

    @classmethod
    def empty(cls, rows: int) -> RowSource:
        return cls(None, None, rows)

    @classmethod
    def gathered(cls, k: Tensor, v: Tensor, order: Tensor) -> RowSource:
        """Rows ``order`` [n] (-1: zero) of k, v [L, kvh, m, d]."""
        if order.dim() != 1 or (order.numel() and int(order.max()) >= k.shape[2]):
            raise ValueError(f"row order must be 1-D with entries < {k.shape[2]}")
        return cls(k, v, order=order.to("cpu", torch.long))

    def taken(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """(rows of k / v taken [n] on k's device, offsets [z] of the zero rows on ``device`` (the cache's),
        None if none); (None, None) for a piece without an order."""
        if self.order is None or self.k is None:
            return None, None
        gaps = (self.order < 0).nonzero().squeeze(1)
        return self.order.clamp_min(0).to(self.k.device), (gaps.to(device) if gaps.numel() else None)


class LoadStaging:
    """A staging buffer, reused from load to load, for a group of layers' keys and values [g, kvh, n, d] in
    the KV dtype on the runtime's device. Owned by one runtime, whose loads run one at a time."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device, budget_bytes: int = LOAD_STAGING_BYTES
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.dtype, self.device, self.budget_bytes = dtype, device, budget_bytes
        self._buffer: Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 before the first load)."""
        return 0 if self._buffer is None else self._buffer.nbytes

    def layer_groups(self, num_layers: int, shape: tuple[int, int, int]) -> list[slice]:
        """Consecutive groups of ``num_layers`` layers whose keys and values of ``shape`` [kvh, n, d] fit the
        budget together (at least one layer a group)."""
        per_layer = 2 * math.prod(shape) * self.dtype.itemsize
        size = max(1, min(num_layers, self.budget_bytes // max(per_layer, 1)))
        return [slice(first, min(first + size, num_layers)) for first in range(0, num_layers, size)]

    def stage(
        self,
        pieces: list[RowSource],
        orders: list[tuple[Tensor | None, Tensor | None]],
        layers: slice,
        shape: tuple[int, int, int],
    ) -> tuple[Tensor, Tensor]:
        """Keys and values [g, kvh, n, d] of ``layers`` (g of them), the pieces' rows one after another: a
        piece's rows (gathered by its order, zero rows at its gaps: ``orders[i]`` is
        :meth:`RowSource.taken`) rounded to the KV dtype, zeros for a piece without KV. Views of the staging
        buffer, valid until the next call."""
        count = layers.stop - layers.start
        keys, values = self._views(count, shape)
        at = 0
        for piece, (take, gaps) in zip(pieces, orders, strict=True):
            span = slice(at, at + piece.rows)
            at = span.stop
            if piece.k is None or piece.v is None:
                keys[:, :, span].zero_()
                values[:, :, span].zero_()
                continue
            k, v = piece.k[layers], piece.v[layers]
            if take is not None:
                k, v = k.index_select(2, take), v.index_select(2, take)
            keys[:, :, span].copy_(k)
            values[:, :, span].copy_(v)
            if gaps is not None:
                keys[:, :, span].index_fill_(2, gaps, 0)
                values[:, :, span].index_fill_(2, gaps, 0)
        return keys, values

    def release_excess(self) -> None:
        """Drop the buffer if it outgrew the budget (a load with more rows per layer than the budget holds
        stages one layer at a time, in a buffer that large): a rare long load does not keep its memory."""
        if self.nbytes > self.budget_bytes:
            self._buffer = None

    def _views(self, count: int, shape: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
        need = 2 * count * math.prod(shape)
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = None  # the old one is freed before the larger one is made
            self._buffer = torch.empty(need, dtype=self.dtype, device=self.device)
        keys, values = self._buffer[:need].view(2, count, *shape).unbind(0)
        return keys, values
