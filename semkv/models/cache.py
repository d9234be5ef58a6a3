"""The live KV cache of one sequence.

Per layer it holds pre-RoPE keys and values in the KV dtype (what the store keeps),
and the rotated keys in the compute dtype (what attention reads), in buffers with
room to grow. Rows are token slots; ``positions`` gives each row's absolute
position, so rows need not be in position order and attention masks come from
positions, never from row order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (layer, rotated queries [nh, A, d], their positions [A]) -> None; see Runtime.forward_rows.
QueryObserver = Callable[[int, Tensor, Tensor], None]


class KVCache:
    """Buffers [kvh, capacity, d] per layer; ``length`` rows are valid."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        kv_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        self.capacity = 0
        self.length = 0
        self.k_pre: list[Tensor] = []
        self.k_rot: list[Tensor] = []
        self.v: list[Tensor] = []
        self.positions = torch.empty(0, dtype=torch.long, device=self.device)
        self.token_ids: list[int] = []
        self.query_observer: QueryObserver | None = None  # set while a prefill's queries are captured
        self.reserve(max(capacity, 1))

    # -- capacity ----------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Grow every buffer to hold at least ``capacity`` rows (amortised doubling)."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity)
        shape = (self.num_kv_heads, new_cap, self.head_dim)

        def grow(old: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
            out = []
            for layer in range(self.num_layers):
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                if old:
                    buf[:, : self.length] = old[layer][:, : self.length]
                out.append(buf)
            return out

        self.k_pre = grow(self.k_pre, self.kv_dtype)
        self.k_rot = grow(self.k_rot, self.compute_dtype)
        self.v = grow(self.v, self.compute_dtype)
        positions = torch.empty(new_cap, dtype=torch.long, device=self.device)
        positions[: self.length] = self.positions[: self.length]
        self.positions = positions
        self.capacity = new_cap

    def append_rows(self, positions: Tensor, token_ids: list[int]) -> int:
        """Claim ``len(positions)`` new rows at the end; returns the first new row index."""
        start = self.length
        count = positions.shape[0]
        self.reserve(start + count)
        self.positions[start : start + count] = positions
        self.token_ids.extend(int(t) for t in token_ids)
        self.length = start + count
        return start

    def truncate(self, length: int) -> None:
        """Forget rows from ``length`` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length {length} outside [0, {self.length}]")
        self.length = length
        del self.token_ids[length:]

    # -- rows ----------------------------------------------------------------------------------
    def write(self, layer: int, rows: Tensor | slice, k_pre: Tensor, k_rot: Tensor, v: Tensor) -> None:
        """Write k_pre/k_rot/v [kvh, n, d] into ``rows`` of ``layer``.

        ``k_pre`` and ``v`` are rounded through the KV dtype, so live attention sees
        exactly what the store would hand back.
        """
        self.k_pre[layer][:, rows] = k_pre.to(self.kv_dtype)
        self.k_rot[layer][:, rows] = k_rot.to(self.compute_dtype)
        self.v[layer][:, rows] = v.to(self.kv_dtype).to(self.compute_dtype)

    def keys(self, layer: int) -> Tensor:
        """Rotated keys of valid rows [kvh, length, d]."""
        return self.k_rot[layer][:, : self.length]

    def values(self, layer: int) -> Tensor:
        """Values of valid rows [kvh, length, d] (compute dtype)."""
        return self.v[layer][:, : self.length]

    def valid_positions(self) -> Tensor:
        return self.positions[: self.length]

    def export(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Pre-RoPE keys and values of rows [start, end) in the KV dtype, each [L, kvh, n, d]."""
        k = torch.stack([self.k_pre[layer][:, start:end] for layer in range(self.num_layers)])
        v = torch.stack([self.v[layer][:, start:end].to(self.kv_dtype) for layer in range(self.num_layers)])
        return k, v

    def nbytes(self) -> int:
        """Bytes of the valid rows at rest (pre-RoPE K + V in the KV dtype)."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.length * self.head_dim * elem
