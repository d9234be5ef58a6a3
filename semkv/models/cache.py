"""The live KV cache of one sequence.

Per layer it holds pre-RoPE keys and values in the KV dtype (what the store keeps),
and the rotated keys in the compute dtype (what attention reads), in buffers with
room to grow. Rows are token slots; ``positions`` gives each row's absolute
position, so rows need not be in position order and attention masks come from
positions, never from row order.

:class:`DecodeArena` holds the buffers of caches decoding together: their per-layer buffers become views
of one [slots, kvh, capacity, d] tensor per layer, so a batched decode step writes and attends over all
of them with one operator each instead of one per sequence.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

# (layer, rotated queries [nh, A, d], their positions [A]) -> None; see Runtime.forward_rows.
QueryObserver = Callable[[int, Tensor, Tensor], None]


HALF_DTYPES = (torch.float16, torch.bfloat16)


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``. Between float16 and bfloat16 it goes through float32: the same bits (every value of
    either type is a float32, so there is one rounding either way) and ~10x faster on CPU, where torch's
    direct conversion took 2.0 ms per 786K elements against 0.16 ms (measured)."""
    if t.dtype != dtype and t.dtype in HALF_DTYPES and dtype in HALF_DTYPES:
        return t.float().to(dtype)
    return t.to(dtype)


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

    def adopt(self, k_pre: list[Tensor], k_rot: list[Tensor], v: list[Tensor]) -> None:
        """Move to the given per-layer buffers [kvh, >= capacity, d] (views of a :class:`DecodeArena`):
        the valid rows are copied there and the old buffers dropped."""
        for layer in range(self.num_layers):
            for new, old in ((k_pre, self.k_pre), (k_rot, self.k_rot), (v, self.v)):
                if new[layer].shape[1] < self.capacity or new[layer].dtype != old[layer].dtype:
                    raise ValueError(f"adopt needs {old[layer].dtype} buffers of >= {self.capacity} rows")
                new[layer][:, : self.length] = old[layer][:, : self.length]
        self.k_pre, self.k_rot, self.v = list(k_pre), list(k_rot), list(v)

    def __deepcopy__(self, memo: dict[int, object]) -> KVCache:
        """An independent cache; buffers that are views of a shared arena are copied alone, not the arena."""
        clone = KVCache.__new__(KVCache)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            if name in ("k_pre", "k_rot", "v"):
                value = [buf.clone() for buf in value]
            else:
                value = copy.deepcopy(value, memo)
            setattr(clone, name, value)
        return clone

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
        self.k_pre[layer][:, rows] = cast(k_pre, self.kv_dtype)
        self.k_rot[layer][:, rows] = k_rot.to(self.compute_dtype)
        self.v[layer][:, rows] = cast(cast(v, self.kv_dtype), self.compute_dtype)

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
        v = torch.stack(
            [cast(self.v[layer][:, start:end], self.kv_dtype) for layer in range(self.num_layers)]
        )
        return k, v

    def nbytes(self) -> int:
        """Bytes of the valid rows at rest (pre-RoPE K + V in the KV dtype)."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.length * self.head_dim * elem


ARENA_ROW_ALIGN = 16  # arena capacity is rounded up to this many rows (attention may read them all)


class DecodeArena:
    """Shared buffers [slots, kvh, capacity, d] per layer (pre-RoPE keys in the KV dtype; rotated keys and
    values in the compute dtype) backing the caches of sequences that decode together.

    A cache bound to slot s has ``arena.k_rot[layer][s]`` (a [kvh, capacity, d] view) as its buffer, and
    likewise for ``k_pre`` and ``v``, so at one layer the rows of every bound cache are one tensor with one
    stride per dimension: a batched decode step writes the new rows of all of them with one indexed write
    and attends over slots ``[lo, hi)`` with one batched matmul, without copying. The cache stays the
    owner of its rows: everything else reads and writes it as before. It stays bound while its buffers
    are these views; :meth:`KVCache.reserve` beyond them gives it buffers of its own (it leaves), and a
    slot is free once its cache is gone (garbage collected) or has left.
    """

    def __init__(self, like: KVCache) -> None:
        """An empty arena for caches laid out as ``like`` (layers, heads, head dim, dtypes, device)."""
        self.layout = (like.num_layers, like.num_kv_heads, like.head_dim, like.kv_dtype, like.compute_dtype)
        self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype, self.compute_dtype = self.layout
        self.device = like.device
        self.capacity = 0
        self.slots: list[weakref.ref[KVCache] | None] = []
        self.k_pre: list[Tensor] = []
        self.k_rot: list[Tensor] = []
        self.v: list[Tensor] = []

    def bound(self, slot: int) -> KVCache | None:
        """The cache bound to ``slot``, or None if the slot is free."""
        ref = self.slots[slot]
        cache = ref() if ref is not None else None
        if cache is None or cache.k_rot[0].data_ptr() != self.k_rot[0][slot].data_ptr():
            return None
        return cache

    def occupied(self) -> int:
        """Number of slots with a bound cache."""
        return sum(self.bound(slot) is not None for slot in range(len(self.slots)))

    def bind(self, caches: list[KVCache]) -> list[int]:
        """The slots of ``caches``, binding those not bound yet (their valid rows are copied into free
        slots; the arena grows, keeping its bound caches, when slots or capacity run short)."""
        where = {
            id(cache): slot for slot in range(len(self.slots)) if (cache := self.bound(slot)) is not None
        }
        new = [cache for cache in caches if id(cache) not in where]
        for cache in new:
            layout = (
                cache.num_layers,
                cache.num_kv_heads,
                cache.head_dim,
                cache.kv_dtype,
                cache.compute_dtype,
            )
            if layout != self.layout or cache.device != self.device:
                raise ValueError(
                    f"cache layout {layout} on {cache.device} differs from the arena's {self.layout}"
                )
        if new:
            free = [slot for slot in range(len(self.slots)) if self.bound(slot) is None]
            capacity = max(cache.capacity for cache in new)
            if len(free) < len(new) or capacity > self.capacity:
                short = len(free) < len(new)
                self._grow(
                    max(len(where) + len(new), 2 * len(self.slots)) if short else len(self.slots), capacity
                )
                free = [slot for slot in range(len(self.slots)) if self.bound(slot) is None]
            for cache, slot in zip(new, free, strict=False):
                cache.adopt(*self._views(slot))
                self.slots[slot] = weakref.ref(cache)
                where[id(cache)] = slot
        return [where[id(cache)] for cache in caches]

    def write(self, layer: int, slots: Tensor, rows: Tensor, k_pre: Tensor, k_rot: Tensor, v: Tensor) -> None:
        """Write one row per bound cache: k_pre/k_rot/v [n, kvh, d] into row ``rows[i]`` of slot
        ``slots[i]`` ([n] each), rounded as :meth:`KVCache.write` rounds."""
        self.k_pre[layer][slots, :, rows] = cast(k_pre, self.kv_dtype)
        self.k_rot[layer][slots, :, rows] = k_rot.to(self.compute_dtype)
        self.v[layer][slots, :, rows] = cast(cast(v, self.kv_dtype), self.compute_dtype)

    def _views(self, slot: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        return tuple([buf[slot] for buf in bufs] for bufs in (self.k_pre, self.k_rot, self.v))  # type: ignore[return-value]

    def _grow(self, slots: int, capacity: int) -> None:
        """Reallocate to at least ``slots`` slots of ``capacity`` rows; bound caches move along (same slot).
        Zero-filled, so the rows past a cache's length are finite (masked scores times zero stay zero)."""
        bound = [(slot, cache) for slot in range(len(self.slots)) if (cache := self.bound(slot)) is not None]
        if bound:
            slots = max(slots, max(slot for slot, _ in bound) + 1)
            capacity = max(capacity, self.capacity)
        capacity = -(-capacity // ARENA_ROW_ALIGN) * ARENA_ROW_ALIGN
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)

        def fresh(dtype: torch.dtype) -> list[Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]

        self.k_pre, self.k_rot, self.v = [], [], []  # bound caches keep the old buffers alive until they move
        self.k_pre, self.k_rot, self.v = (
            fresh(self.kv_dtype),
            fresh(self.compute_dtype),
            fresh(self.compute_dtype),
        )
        self.capacity = capacity
        self.slots = [None] * slots
        for slot, cache in bound:
            cache.adopt(*self._views(slot))
            self.slots[slot] = weakref.ref(cache)
