"""The live KV cache of one sequence.

Per layer it holds pre-RoPE keys and values in the KV dtype (what the store keeps),
and the rotated keys in the compute dtype (what attention reads), in buffers with
room to grow. Rows are token slots; ``positions`` gives each row's absolute
position, so rows need not be in position order and attention masks come from
positions, never from row order.

:class:`DecodeArena` holds the buffers of caches decoding together: their per-layer buffers become views
of one [slots, kvh, capacity, d] tensor per layer, so a batched decode step writes and attends over all
of them with one operator each instead of one per sequence.

A cache may start from a :class:`SharedPrefix`: rows ``0 .. base - 1`` are read from buffers several
caches hold together (a stored prompt's pages gathered once), and the cache's own buffers hold rows
``base`` on. Attention reads the two pieces (:meth:`KVCache.keys`, and the two-piece kernels in
:mod:`semkv.models.kernels`); anything that reaches for the whole buffers (``k_pre``, ``k_rot``, ``v``) or
writes a prefix row first copies the prefix in (:meth:`KVCache.unshare`: copy-on-write of the whole prefix).

KV memory held (what the scheduler's live-KV budget counts): an arena holds ``len(slots) * capacity *
row_bytes`` bytes, free slots and the padding of short caches included; a cache holds
``(capacity - base) * row_bytes`` bytes of its own while it is not bound to an arena, and none while it
is; a shared prefix is counted once, however many caches hold it (the runtime's ``kv_held_bytes``).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from semkv.models.adapters import rotate_queries
from semkv.models.kernels import in_order


@dataclass(frozen=True)
class ObservedQueries:
    """One layer's queries as a forward computed them, handed to a cache's ``query_observer``.

    q: [nh, A, d] pre-RoPE queries (after the family's query norm); cos / sin: [A, d] their rotary
    tables; positions: [A] their absolute positions; dtype: the compute dtype the attention rounds the
    rotated queries to. The rotation is left to the observer, which usually keeps a few rows: rotating
    every row of a long prompt at every layer cost a visible share of the prefill.
    """

    q: Tensor
    cos: Tensor
    sin: Tensor
    positions: Tensor
    dtype: torch.dtype

    def rotated(self, offsets: Tensor | None = None) -> Tensor:
        """[nh, n, d] the rows at ``offsets`` [n] (every row: None) rotated as the attention used them
        (RoPE in float32, rounded to the compute dtype)."""
        q, cos, sin = self.q, self.cos, self.sin
        if offsets is not None:
            q, cos, sin = q[:, offsets], cos[offsets], sin[offsets]
        return rotate_queries(q, cos, sin, self.dtype)


# (layer, its queries) -> None; see Runtime.forward_rows.
QueryObserver = Callable[[int, ObservedQueries], None]
# (layer, first row, end row) -> pre-RoPE keys [kvh, end - first, d]; see SharedPrefix
KeyRows = Callable[[int, int, int], Tensor]


HALF_DTYPES = (torch.float16, torch.bfloat16)


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``. Between float16 and bfloat16 it goes through float32: the same bits (every value of
    either type is a float32, so there is one rounding either way) and much faster on CPU than torch's
    direct conversion."""
    if t.dtype != dtype and t.dtype in HALF_DTYPES and dtype in HALF_DTYPES:
        return t.float().to(dtype)
    return t.to(dtype)


class SharedPrefix:
    """Rows ``0 .. rows - 1`` (positions 0 .. rows - 1) of a prompt held once for every cache that starts
    with them. Read-only: a cache that must change a prefix row copies the prefix in first
    (:meth:`KVCache.unshare`). ``holders``: the caches reading it now (weak: a cache dropped stops holding).

    Per layer: ``k_rot`` [kvh, rows, d] rotated keys and ``v`` [kvh, rows, d] values in the compute dtype
    (views of page pool buffers or copies; only the row dimension need be contiguous); pre-RoPE keys are
    read on demand (``k_pre_rows(layer, start, end)`` -> [kvh, end - start, d] in ``kv_dtype``: from the
    page pool's pages, which ``keep`` holds while the prefix lives, so they are not kept twice). A batched
    decode step of several readers joins the prefix's rows and theirs into one matrix per layer, in the
    compute dtype; where it takes the two-piece kernel instead (many readers with long own rows), that
    sums the prefix's share of a query's output in float32 and rounds once, as a one-piece product over
    the joined rows does: :meth:`float_values` widens the values to float32 for it the first time (once,
    every layer; the prefix then holds the float32 values instead).
    """

    def __init__(
        self,
        k_rot: list[Tensor],
        v: list[Tensor],
        token_ids: list[int],
        k_pre_rows: KeyRows,
        kv_dtype: torch.dtype,
        keep: object = None,
    ) -> None:
        rows = k_rot[0].shape[1] if k_rot else 0
        if len(token_ids) != rows or len(k_rot) != len(v):
            raise ValueError(f"a shared prefix of {rows} rows needs as many token ids, got {len(token_ids)}")
        if any(t.dtype != k.dtype for t, k in zip(v, k_rot, strict=True)):
            raise ValueError("a shared prefix holds its keys and values in one (the compute) dtype")
        self.k_rot, self.v = k_rot, v
        self.token_ids = tuple(token_ids)
        self.rows = rows
        self.k_pre_rows = k_pre_rows
        self.kv_dtype = kv_dtype
        self.keep = keep
        self.holders: weakref.WeakSet[KVCache] = weakref.WeakSet()

    @classmethod
    def of_rows(
        cls, k_pre: list[Tensor], k_rot: list[Tensor], v: list[Tensor], token_ids: list[int]
    ) -> SharedPrefix:
        """A prefix holding the given per-layer rows [kvh, rows, d] itself (pre-RoPE keys in the KV dtype,
        rotated keys and values in the compute dtype)."""
        return cls(
            k_rot,
            v,
            token_ids,
            lambda layer, start, end: k_pre[layer][:, start:end],
            k_pre[0].dtype,
            keep=k_pre,
        )

    @property
    def num_layers(self) -> int:
        return len(self.k_rot)

    def float_values(self, layer: int) -> Tensor:
        """Values of ``layer`` [kvh, rows, d] in float32. The first call widens every layer's values and
        keeps only the widened ones (the compute-dtype rows are the float32 values rounded back)."""
        if self.v[layer].dtype != torch.float32:
            self.v = [t.float() for t in self.v]
        return self.v[layer]

    def held_by_others(self, cache: KVCache) -> bool:
        """Whether a cache other than ``cache`` reads this prefix now."""
        return any(holder is not cache for holder in list(self.holders))

    def nbytes(self) -> int:
        """Bytes of the rows the prefix's readers attend over: rotated keys and values as held (compute
        dtype, or float32 values once widened), whether views of pool pages or copies; pre-RoPE keys only
        where it holds them itself (not read from pool pages)."""
        held = [*self.k_rot, *self.v]
        if isinstance(self.keep, list):
            held += [t for t in self.keep if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in held)


class KVCache:
    """Buffers [kvh, capacity, d] per layer; ``length`` rows are valid.

    With a :class:`SharedPrefix` (:meth:`share_prefix`), rows below ``base`` are the prefix's and the own
    buffers [kvh, capacity - base, d] hold rows ``base`` on (own row i is cache row ``base + i``).
    """

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
        self.prefix: SharedPrefix | None = None  # rows 0 .. base - 1 read from here (share_prefix)
        self.base = 0
        self.positions = torch.empty(0, dtype=torch.long, device=self.device)
        self.token_ids: list[int] = []
        self.query_observer: QueryObserver | None = None  # set while a prefill's queries are captured
        self.in_arena = False  # the own buffers are views of a DecodeArena slot (see adopt)
        # host copies of facts about ``positions``, read from the device once and kept while decode rows
        # append in order (see ordered, position_span); None: not known
        self._in_order: bool | None = None
        self._span: int | None = None
        # Rows the first allocation makes: buffers are allocated when rows first arrive (reserve), so a
        # cache that starts from a shared prefix allocates only its own rows (share_prefix).
        self._planned = max(capacity, 1)
        empty = (num_kv_heads, 0, head_dim)  # own buffers: rows base ..
        self._k_pre = [torch.empty(empty, dtype=kv_dtype, device=self.device) for _ in range(num_layers)]
        self._k_rot = [torch.empty(empty, dtype=compute_dtype, device=self.device) for _ in range(num_layers)]
        self._v = [torch.empty(empty, dtype=compute_dtype, device=self.device) for _ in range(num_layers)]

    # -- whole buffers (a shared prefix is copied in first) ------------------------------------------
    @property
    def k_pre(self) -> list[Tensor]:
        """Pre-RoPE keys [kvh, capacity, d] per layer (KV dtype); copies a shared prefix in first."""
        self.unshare()
        return self._k_pre

    @property
    def k_rot(self) -> list[Tensor]:
        """Rotated keys [kvh, capacity, d] per layer (compute dtype); copies a shared prefix in first."""
        self.unshare()
        return self._k_rot

    @property
    def v(self) -> list[Tensor]:
        """Values [kvh, capacity, d] per layer (compute dtype); copies a shared prefix in first."""
        self.unshare()
        return self._v

    @property
    def own_k_pre(self) -> list[Tensor]:
        """The own buffers [kvh, capacity - base, d] per layer, rows ``base`` on (no copy)."""
        return self._k_pre

    @property
    def own_k_rot(self) -> list[Tensor]:
        return self._k_rot

    @property
    def own_v(self) -> list[Tensor]:
        return self._v

    @property
    def own_length(self) -> int:
        """Valid rows in the own buffers."""
        return self.length - self.base

    @property
    def own_capacity(self) -> int:
        """Rows the own buffers may hold."""
        return self.capacity - self.base

    @property
    def row_bytes(self) -> int:
        """Bytes one row takes over every layer: pre-RoPE K in the KV dtype, rotated K and V in the compute
        dtype."""
        return row_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype, self.compute_dtype)

    def held_bytes(self) -> int:
        """Bytes of the buffers this cache holds on its own: ``capacity - base`` rows, or 0 while they are
        views of a :class:`DecodeArena` slot (the arena counts them). A shared prefix is not counted here
        (its holders share it), nor are positions and token ids. Before its first rows arrive a cache counts
        the rows it was made for (its buffers are allocated then)."""
        return 0 if self.in_arena else max(self.own_capacity, self._planned) * self.row_bytes

    # -- the shared prefix ---------------------------------------------------------------------------
    def share_prefix(self, prefix: SharedPrefix, rows: int | None = None) -> None:
        """Start this empty cache with the first ``rows`` rows of ``prefix`` (default: all) at positions
        0 .. rows - 1, read from the prefix's buffers (no copy). Own buffers outside an arena shrink to
        the rows left (``capacity - rows``)."""
        if self.length or self.prefix is not None:
            raise ValueError("share_prefix needs an empty cache")
        rows = prefix.rows if rows is None else rows
        if not 0 < rows <= prefix.rows:
            raise ValueError(f"share_prefix: {rows} rows asked of a prefix of {prefix.rows}")
        first = prefix.k_rot[0]
        layout = (first.shape[0], first.shape[2], prefix.kv_dtype, prefix.num_layers)
        if layout != (self.num_kv_heads, self.head_dim, self.kv_dtype, self.num_layers):
            raise ValueError(f"shared prefix layout {layout} differs from the cache's")
        if self.in_arena:
            self.reserve(rows + 1)
        else:
            capacity = max(self.capacity, self._planned, rows + 1)
            shape = (self.num_kv_heads, capacity - rows, self.head_dim)
            self._k_pre = [torch.empty(shape, dtype=self.kv_dtype, device=self.device) for _ in self._k_pre]
            self._k_rot = [
                torch.zeros(shape, dtype=self.compute_dtype, device=self.device) for _ in self._k_rot
            ]
            self._v = [torch.zeros(shape, dtype=self.compute_dtype, device=self.device) for _ in self._v]
            self.positions = torch.empty(capacity, dtype=torch.long, device=self.device)
            self.capacity, self._planned = capacity, 0
        self.append_rows(torch.arange(rows, device=self.device), list(prefix.token_ids[:rows]))
        self._in_order, self._span = True, max(rows - 1, 0)
        self.prefix, self.base = prefix, rows
        prefix.holders.add(self)

    def unshare(self) -> None:
        """Copy the shared prefix's rows into buffers of this cache's own (copy-on-write of the whole
        prefix) and stop reading it; nothing without one. A cache bound to an arena leaves it."""
        prefix = self.prefix
        if prefix is None:
            return
        base, own = self.base, self.own_length
        shape = (self.num_kv_heads, self.capacity, self.head_dim)
        mine: list[list[Tensor]] = []
        for shared, bufs, dtype in (
            ("k_pre", self._k_pre, self.kv_dtype),
            ("k_rot", self._k_rot, self.compute_dtype),
            ("v", self._v, self.compute_dtype),
        ):
            layers = []
            for layer in range(self.num_layers):
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                buf[:, :base] = self._prefix_rows(shared, layer, 0, base)
                buf[:, base : base + own] = bufs[layer][:, :own]
                buf[:, base + own :].zero_()  # finite rows past the length (see reserve)
                layers.append(buf)
            mine.append(layers)
        self._k_pre, self._k_rot, self._v = mine
        prefix.holders.discard(self)
        self.prefix, self.base, self.in_arena = None, 0, False

    # -- capacity ----------------------------------------------------------------------------
    def reserve(self, capacity: int) -> None:
        """Grow every buffer to hold at least ``capacity`` rows (amortised doubling)."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, 2 * self.capacity, self._planned)
        self._planned = 0
        shape = (self.num_kv_heads, new_cap - self.base, self.head_dim)
        own = self.own_length

        def grow(old: list[Tensor], dtype: torch.dtype, zero_tail: bool) -> list[Tensor]:
            out = []
            for layer in range(self.num_layers):
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                if old:
                    buf[:, :own] = old[layer][:, :own]
                if zero_tail:
                    buf[:, own:].zero_()
                out.append(buf)
            return out

        # Rows past the length are finite (zeros, or rows written before a truncation): a decode step may
        # attend over the whole buffer with those rows masked (0 x value must be 0, never NaN).
        self._k_pre = grow(self._k_pre, self.kv_dtype, zero_tail=False)
        self._k_rot = grow(self._k_rot, self.compute_dtype, zero_tail=True)
        self._v = grow(self._v, self.compute_dtype, zero_tail=True)
        positions = torch.empty(new_cap, dtype=torch.long, device=self.device)
        positions[: self.length] = self.positions[: self.length]
        self.positions = positions
        self.capacity = new_cap
        self.in_arena = False

    def append_rows(self, positions: Tensor, token_ids: list[int]) -> int:
        """Claim ``len(positions)`` new rows at the end; returns the first new row index."""
        start = self.length
        count = positions.shape[0]
        self.reserve(start + count)
        self.positions[start : start + count] = positions
        self.token_ids.extend(int(t) for t in token_ids)
        self.length = start + count
        self._in_order = self._span = None
        return start

    def append_next(self, token_id: int) -> int:
        """Claim one row at the position after the last row's (0 for an empty cache), computed on the device
        (no host read); returns the row. What :meth:`ordered` and :meth:`position_span` knew stays true
        (one more in order, one wider)."""
        in_order, span = self._in_order, self._span
        if self.length:
            position = self.positions[self.length - 1 : self.length] + 1
        else:
            position = torch.zeros(1, dtype=torch.long, device=self.device)
            in_order, span = True, -1
        row = self.append_rows(position, [token_id])
        self._in_order = in_order
        self._span = None if span is None else span + 1
        return row

    def ordered(self) -> bool:
        """The valid rows' positions never decrease (read from the device once, then kept)."""
        if self._in_order is None:
            self._in_order = in_order(self.valid_positions())
        return self._in_order

    def position_span(self) -> int:
        """The last row's position minus the first row's (read from the device once, then kept)."""
        if self._span is None:
            self._span = int(self.positions[self.length - 1] - self.positions[0]) if self.length else 0
        return self._span

    def adopt(self, k_pre: list[Tensor], k_rot: list[Tensor], v: list[Tensor], capacity: int = 0) -> None:
        """Move the own rows to the given per-layer buffers [kvh, >= capacity - base, d] (views of a
        :class:`DecodeArena` slot): the valid own rows are copied there and the old buffers dropped.
        ``capacity``: rows the cache may use from then on, if more than it has (at most the buffers' rows
        plus ``base``)."""
        rows = k_pre[0].shape[1]
        if capacity - self.base > rows:
            raise ValueError(f"adopt capacity {capacity} exceeds the buffers' {rows} rows")
        self._planned = 0
        if capacity > self.capacity:
            positions = torch.empty(capacity, dtype=torch.long, device=self.device)
            positions[: self.length] = self.positions[: self.length]
            self.positions, self.capacity = positions, capacity
        for layer in range(self.num_layers):
            self.adopt_layer(layer, k_pre[layer], k_rot[layer], v[layer])

    def adopt_layer(self, layer: int, k_pre: Tensor, k_rot: Tensor, v: Tensor) -> None:
        """Move ``layer``'s own rows to the given buffers [kvh, >= capacity - base, d] (its valid own rows
        are copied there); the old ones are dropped, so an arena reallocated layer by layer frees each old
        layer as it goes."""
        own = self.own_length
        for new, old in ((k_pre, self._k_pre), (k_rot, self._k_rot), (v, self._v)):
            if new.shape[1] < self.own_capacity or new.dtype != old[layer].dtype:
                raise ValueError(f"adopt needs {old[layer].dtype} buffers of >= {self.own_capacity} rows")
            new[:, :own] = old[layer][:, :own]
        self._k_pre[layer], self._k_rot[layer], self._v[layer] = k_pre, k_rot, v
        self.in_arena = True  # once every layer has moved (a reallocation moves one layer at a time)

    def __deepcopy__(self, memo: dict[int, object]) -> KVCache:
        """An independent cache; own buffers that are views of a shared arena are copied alone, not the
        arena. A shared prefix stays shared (read-only): the copy holds it too."""
        clone = KVCache.__new__(KVCache)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            if name in ("_k_pre", "_k_rot", "_v"):
                value = [buf[:, : self.own_capacity].clone() for buf in value]  # an arena slot may be longer
            elif name == "in_arena":
                value = False
            elif name == "prefix":
                pass
            else:
                value = copy.deepcopy(value, memo)
            setattr(clone, name, value)
        if clone.prefix is not None:
            clone.prefix.holders.add(clone)
        return clone

    def truncate(self, length: int) -> None:
        """Forget rows from ``length`` on (below ``base``: the shared prefix is copied in first)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length {length} outside [0, {self.length}]")
        if length < self.base:
            self.unshare()
        self.length = length
        del self.token_ids[length:]
        self._span = None  # the last position changed; rows left in order stay in order

    # -- rows ----------------------------------------------------------------------------------
    def _own_rows(self, rows: Tensor | slice) -> Tensor | slice:
        """``rows`` (cache rows) as indices into the own buffers: a contiguous slice at or past ``base``
        shifted by it; anything else (a slice reaching below ``base``, an index tensor, which would need a
        device read to check) copies the shared prefix in first and is returned as it is."""
        base = self.base
        if not base:
            return rows
        if isinstance(rows, slice):
            start = 0 if rows.start is None else rows.start
            if start >= base and rows.step in (None, 1):
                stop = None if rows.stop is None else rows.stop - base
                return slice(start - base, stop)
        self.unshare()
        return rows

    def write(self, layer: int, rows: Tensor | slice, k_pre: Tensor, k_rot: Tensor, v: Tensor) -> None:
        """Write k_pre/k_rot/v [kvh, n, d] into ``rows`` of ``layer`` (a shared prefix row is copied in
        first).

        ``k_pre`` and ``v`` are rounded through the KV dtype, so live attention sees
        exactly what the store would hand back.
        """
        own = self._own_rows(rows)
        self._k_pre[layer][:, own] = cast(k_pre, self.kv_dtype)
        self._k_rot[layer][:, own] = k_rot.to(self.compute_dtype)
        self._v[layer][:, own] = cast(cast(v, self.kv_dtype), self.compute_dtype)

    def row_buffers(self, layer: int, rows: slice) -> tuple[Tensor, Tensor, Tensor]:
        """Views of ``rows`` of ``layer``: pre-RoPE keys (KV dtype), rotated keys and values (compute dtype),
        each [kvh, n, d], for a loader that fills them in place with what :meth:`write` would write (values
        rounded through the KV dtype, rotated keys rotated from the KV-dtype keys). Rows below ``base``
        copy a shared prefix in first."""
        own = self._own_rows(rows)
        return self._k_pre[layer][:, own], self._k_rot[layer][:, own], self._v[layer][:, own]

    def keys(self, layer: int, rows: int | None = None) -> Tensor:
        """Rotated keys of the first ``rows`` rows [kvh, rows, d] (default: the valid ones; up to the
        capacity, rows past the length being finite leftovers for a caller that masks them; with a shared
        prefix: a new tensor of both pieces)."""
        return self._rows_of("k_rot", layer, 0, self.length if rows is None else self._readable(rows))

    def values(self, layer: int, rows: int | None = None) -> Tensor:
        """Values of the first ``rows`` rows [kvh, rows, d] (compute dtype; as :meth:`keys`)."""
        return self._rows_of("v", layer, 0, self.length if rows is None else self._readable(rows))

    def _readable(self, rows: int) -> int:
        if not self.length <= rows <= self.capacity:
            raise ValueError(
                f"{rows} rows asked of a cache of {self.length} valid rows, {self.capacity} capacity"
            )
        return rows

    def valid_positions(self) -> Tensor:
        return self.positions[: self.length]

    def export(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Pre-RoPE keys and values of rows [start, end) in the KV dtype, each [L, kvh, n, d]."""
        layers = range(self.num_layers)
        k = torch.stack([self._rows_of("k_pre", layer, start, end) for layer in layers])
        v = torch.stack([cast(self._rows_of("v", layer, start, end), self.kv_dtype) for layer in layers])
        return k, v

    def kv_rows(self, layer: int, start: int) -> tuple[Tensor, Tensor]:
        """Rotated keys and values of rows [start, length) of ``layer``, each [kvh, n, d] (a new tensor
        when they span a shared prefix and the own rows)."""
        return self._rows_of("k_rot", layer, start, self.length), self._rows_of(
            "v", layer, start, self.length
        )

    def _rows_of(self, name: str, layer: int, start: int, end: int) -> Tensor:
        """Rows [start, end) of buffer ``name`` ("k_pre", "k_rot" or "v") of ``layer``, [kvh, n, d] in the
        cache's dtype for it, read across the shared prefix and the own buffers without copying the prefix
        in (rows of both pieces: a new tensor)."""
        base, own = self.base, getattr(self, "_" + name)[layer]
        if self.prefix is None or start >= base:
            return own[:, start - base : end - base]
        shared = self._prefix_rows(name, layer, start, min(end, base))
        if end <= base:
            return shared
        return torch.cat((shared, own[:, : end - base]), dim=1)

    def _prefix_rows(self, name: str, layer: int, start: int, end: int) -> Tensor:
        """Rows [start, end) of the shared prefix's buffer ``name`` in the cache's dtype for it."""
        prefix = self.prefix
        assert prefix is not None
        if name == "k_pre":
            return prefix.k_pre_rows(layer, start, end)
        rows = (prefix.k_rot if name == "k_rot" else prefix.v)[layer][:, start:end]
        return rows.to(self.compute_dtype)

    def nbytes(self) -> int:
        """Bytes of the valid rows at rest (pre-RoPE K + V in the KV dtype)."""
        elem = self.kv_dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.length * self.head_dim * elem


def row_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype, compute_dtype: torch.dtype
) -> int:
    """Bytes one token row takes in a live cache over every layer (pre-RoPE K in the KV dtype, rotated K
    and V in the compute dtype)."""
    kv = kv_dtype.itemsize
    compute = compute_dtype.itemsize
    return num_layers * num_kv_heads * head_dim * (kv + 2 * compute)


ARENA_ROW_ALIGN = 16  # arena capacity is rounded up to this many rows (attention may read them all)
SHRINK_BELOW = 4  # an arena shrinks when at most 1 / SHRINK_BELOW of its slots are bound


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

    Memory: the arena holds :meth:`nbytes` (every slot, free or not, at the full capacity). It grows when
    caches bind and slots or capacity run short (slots doubled, or just enough when a doubling would pass
    ``max_growth``; see :meth:`bind`), never beyond what the caller allows, and shrinks when few slots stay
    bound (:meth:`shrink`). A reallocation moves the bound caches to the first slots and sizes the
    capacity to the widest cache it holds (the padding a wide cache that left imposed goes back); it goes
    layer by layer, so beside the larger of the old and new buffers it holds one layer of the other
    (:meth:`reallocation_peak`), not both whole. A new cache can start in a free slot (:meth:`claim`), so a
    request admitted while a slot is free costs no memory beyond the arena's and needs no copy later.
    """

    def __init__(self, like: KVCache) -> None:
        """An empty arena for caches laid out as ``like`` (layers, heads, head dim, dtypes, device)."""
        self.layout = (like.num_layers, like.num_kv_heads, like.head_dim, like.kv_dtype, like.compute_dtype)
        self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype, self.compute_dtype = self.layout
        self.row_bytes = row_bytes(*self.layout)
        self.device = like.device
        self.capacity = 0
        self.slots: list[weakref.ref[KVCache] | None] = []
        self.k_pre: list[Tensor] = []
        self.k_rot: list[Tensor] = []
        self.v: list[Tensor] = []

    def nbytes(self, slots: int | None = None, capacity: int | None = None) -> int:
        """Bytes the buffers hold (free slots and padding rows included); with ``slots`` / ``capacity``:
        what they would hold at that size."""
        slots = len(self.slots) if slots is None else slots
        capacity = self.capacity if capacity is None else capacity
        return slots * capacity * self.row_bytes

    def reallocation_peak(self, slots: int, capacity: int, joining: int = 0) -> int:
        """The most bytes held, by the arena and the own buffers (``joining`` bytes) of caches moving in,
        while reallocating to ``slots`` x ``capacity`` rows (aligned): layer by layer, each old layer (and
        the joining caches' layer) is freed once the new one is filled, so the peak is the larger of before
        (old + joining) and after (new) plus one layer of the smaller."""
        before, after = self.nbytes() + joining, self.nbytes(slots, _aligned(capacity))
        return max(before, after) + min(before, after) // self.num_layers

    def bound(self, slot: int) -> KVCache | None:
        """The cache bound to ``slot``, or None if the slot is free."""
        ref = self.slots[slot]
        cache = ref() if ref is not None else None
        if cache is None or cache.own_k_rot[0].data_ptr() != self.k_rot[0][slot].data_ptr():
            return None
        return cache

    def occupied(self) -> int:
        """Number of slots with a bound cache."""
        return sum(self.bound(slot) is not None for slot in range(len(self.slots)))

    def free_slots(self) -> list[int]:
        return [slot for slot in range(len(self.slots)) if self.bound(slot) is None]

    def bind(self, caches: list[KVCache], max_growth: int | None = None) -> list[int | None]:
        """The slots of ``caches``, binding those not bound yet (their valid rows are copied into free
        slots). When slots or capacity run short the arena grows, keeping its bound caches: to twice the
        slots, or to just the slots needed when the doubling's :meth:`reallocation_peak` would exceed the
        bytes held before (arena and joining caches) by more than ``max_growth`` (None: no limit). When that
        too would, the widest of the joining caches give up their place until the rest fit; those left out
        stay unbound (None in the result) and decode on their own buffers."""
        where = {
            id(cache): slot for slot in range(len(self.slots)) if (cache := self.bound(slot)) is not None
        }
        new = [cache for cache in caches if id(cache) not in where]
        for cache in new:
            self._check_layout(cache)
        if not new:
            return [where[id(cache)] for cache in caches]
        narrowest = sorted(new, key=lambda cache: cache.own_capacity)
        for group in [new] + [narrowest[:count] for count in range(len(new) - 1, 0, -1)]:
            if self._join(group, len(where), max_growth):
                break
        where = {
            id(cache): slot for slot in range(len(self.slots)) if (cache := self.bound(slot)) is not None
        }
        return [where.get(id(cache)) for cache in caches]

    def _join(self, new: list[KVCache], bound: int, max_growth: int | None) -> bool:
        """Bind ``new`` (none bound yet; ``bound`` slots taken), growing within ``max_growth`` if needed;
        False, changing nothing, if that would pass it."""
        needed = bound + len(new)  # more than len(self.slots) iff free slots run short
        if needed <= len(self.slots) and max(cache.own_capacity for cache in new) <= self.capacity:
            for cache, slot in zip(new, self.free_slots(), strict=False):
                cache.adopt(*self._views(slot))
                self.slots[slot] = weakref.ref(cache)
            return True
        doubled = max(needed, 2 * len(self.slots)) if needed > len(self.slots) else len(self.slots)
        capacity = self._widest(new)
        joining = sum(cache.held_bytes() for cache in new)
        for slots in dict.fromkeys((doubled, max(needed, len(self.slots)))):
            peak = self.reallocation_peak(slots, capacity, joining)
            if max_growth is None or peak - self.nbytes() - joining <= max_growth:
                self._reallocate(slots, capacity, joining=new)
                return True
        return False

    def claim(self, cache: KVCache, capacity: int) -> bool:
        """Bind a new (empty) cache to a free slot at least ``capacity`` rows wide, without growing, and
        let it use that many rows; False (the cache keeps its own buffers) if there is none. A cache made
        this way holds no memory of its own: a request started in a free slot costs no KV bytes beyond
        the arena's."""
        self._check_layout(cache)
        free = self.free_slots()
        if capacity > self.capacity or not free:
            return False
        cache.adopt(*self._views(free[0]), capacity=capacity)
        self.slots[free[0]] = weakref.ref(cache)
        return True

    def claimable(self, capacities: list[int]) -> list[bool]:
        """Whether caches of these capacities, made in this order, would each :meth:`claim` a slot."""
        free = len(self.free_slots())
        fits = []
        for capacity in capacities:
            ok = free > 0 and capacity <= self.capacity
            free -= ok
            fits.append(ok)
        return fits

    def shrink(self, max_growth: int | None = None) -> bool:
        """Reallocate to the bound caches only (capacity their widest) when at most ``1 / SHRINK_BELOW`` of
        the slots are bound, so the memory of sequences that left goes back instead of waiting for the
        arena to empty; not if the :meth:`reallocation_peak` would exceed the current bytes by more than
        ``max_growth`` (None: no limit). True if it did."""
        bound = self.occupied()
        if not bound or SHRINK_BELOW * bound > len(self.slots):
            return False
        capacity = self._widest([])
        if max_growth is not None and self.reallocation_peak(bound, capacity) - self.nbytes() > max_growth:
            return False
        self._reallocate(bound, capacity)
        return True

    def write(self, layer: int, slots: Tensor, rows: Tensor, k_pre: Tensor, k_rot: Tensor, v: Tensor) -> None:
        """Write one row per bound cache: k_pre/k_rot/v [n, kvh, d] into row ``rows[i]`` of slot
        ``slots[i]`` ([n] each), rounded as :meth:`KVCache.write` rounds."""
        self.k_pre[layer][slots, :, rows] = cast(k_pre, self.kv_dtype)
        self.k_rot[layer][slots, :, rows] = k_rot.to(self.compute_dtype)
        self.v[layer][slots, :, rows] = cast(cast(v, self.kv_dtype), self.compute_dtype)

    def _check_layout(self, cache: KVCache) -> None:
        layout = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.kv_dtype, cache.compute_dtype)
        if layout != self.layout or cache.device != self.device:
            raise ValueError(
                f"cache layout {layout} on {cache.device} differs from the arena's {self.layout}"
            )

    def _views(self, slot: int) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        return tuple([buf[slot] for buf in bufs] for bufs in (self.k_pre, self.k_rot, self.v))  # type: ignore[return-value]

    def _widest(self, joining: list[KVCache]) -> int:
        """The capacity (aligned) of the bound caches and ``joining``: what a reallocation allocates."""
        caches = [cache for slot in range(len(self.slots)) if (cache := self.bound(slot)) is not None]
        return _aligned(max(cache.own_capacity for cache in caches + joining))

    def _reallocate(self, slots: int, capacity: int, joining: list[KVCache] | None = None) -> None:
        """Reallocate to ``slots`` slots of ``capacity`` rows, layer by layer: the bound caches, then the
        ``joining`` ones, move to the first slots (in slot order), each layer's old buffers freed as it
        goes. Zero-filled, so the rows past a cache's length are finite (masked scores times zero stay
        zero)."""
        bound = [cache for slot in range(len(self.slots)) if (cache := self.bound(slot)) is not None]
        placed = list(enumerate(bound + (joining or [])))
        if len(placed) > slots or any(cache.own_capacity > capacity for _, cache in placed):
            raise ValueError(f"{len(placed)} caches do not fit {slots} slots of {capacity} rows")
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        dtypes = (self.kv_dtype, self.compute_dtype, self.compute_dtype)
        if not self.k_pre:
            self.k_pre, self.k_rot, self.v = ([None] * self.num_layers for _ in dtypes)  # type: ignore[misc]
        for layer in range(self.num_layers):
            with torch.inference_mode(False):  # normal tensors: a cache may be prefilled in its slot later
                fresh = [torch.zeros(shape, dtype=dtype, device=self.device) for dtype in dtypes]
            for slot, cache in placed:
                cache.adopt_layer(layer, fresh[0][slot], fresh[1][slot], fresh[2][slot])
            self.k_pre[layer], self.k_rot[layer], self.v[layer] = fresh  # the old layer is freed here
        self.capacity = capacity
        self.slots = [None] * slots
        for slot, cache in placed:
            self.slots[slot] = weakref.ref(cache)


def _aligned(capacity: int) -> int:
    return -(-capacity // ARENA_ROW_ALIGN) * ARENA_ROW_ALIGN
