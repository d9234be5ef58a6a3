"""Per-block summaries computed when a block is written, and queries captured at prefill.

:class:`BlockIndex` holds what policies read about each *complete* block (its rows
written at every layer). A block is summarised once, by :meth:`BlockIndex.add_blocks`,
the per-block operation every writer calls once it has written a block's rows: the
engine after a prefill (or a chunk of one), the sparse decoder when a decode step has
completed a block. Summaries a stored prefix block carries come in through
:meth:`BlockIndex.insert` instead of being recomputed. Per block, every layer and KV head:

* ``mean`` [L, kvh, d]: mean pre-RoPE key (Key-Key's raw material; pooled per request);
* ``sq`` [L, kvh]: mean square of the pre-RoPE keys (with ``mean``: each head's key variance,
  Key-Key's head weights);
* ``min`` / ``max`` [L, kvh, d]: per-channel min / max of the rotated keys (Quest's bound);
* ``rmean`` [L, kvh, d]: mean rotated key (the mean logit ``q . rmean`` of a block for a query).

One level up, per chunk of :data:`CHUNK_BLOCKS` consecutive blocks (chunk ``c`` = blocks ``[4c, 4c + 4)``),
the chunk's mean rotated key (:meth:`BlockIndex.chunk_means`), updated as its blocks arrive.

Summaries are rounded through the KV dtype when computed, so a block's summaries read back
from the store equal those of a fresh prefill bit for bit (as the cache does for KV).

:class:`PrefillQueries` holds rotated queries of a few prompt tokens per layer
(the last ``window`` tokens plus every ``stride``-th token from the end), captured
through the cache's query observer while the prompt is prefilled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from semkv.models.cache import KVCache, ObservedQueries

SUMMARY_KINDS = ("mean", "sq", "min", "max", "rmean")
CHUNK_BLOCKS = 4  # blocks per chunk of the level above the blocks


def summarise_rows(k_pre: Tensor, k_rot: Tensor, block_size: int, kv_dtype: torch.dtype) -> dict[str, Tensor]:
    """Summaries of whole blocks of one layer. k_pre, k_rot: [kvh, n * block_size, d] ->
    {kind: [kvh, n, d] (sq: [kvh, n])}, float32 values rounded through ``kv_dtype``."""
    kvh, rows, d = k_pre.shape
    pre32 = k_pre.reshape(kvh, rows // block_size, block_size, d).float()
    # min / max of the float32 copy: exact (widening is), and faster on CPU than in 16 bits
    rot32 = k_rot.reshape(kvh, rows // block_size, block_size, d).float()
    out = {
        "mean": pre32.mean(dim=2),
        "sq": pre32.square().mean(dim=(2, 3)),
        "min": rot32.amin(dim=2),
        "max": rot32.amax(dim=2),
        "rmean": rot32.mean(dim=2),
    }
    return {kind: t.to(kv_dtype).float() for kind, t in out.items()}


class BlockIndex:
    """Summaries of the complete blocks of one cache (block = ``block_size`` consecutive rows).

    Buffers per kind: ``[L, kvh, capacity blocks, d]`` (``sq``: ``[L, kvh, capacity blocks]``),
    grown by doubling; ``num_complete`` blocks are valid.
    """

    def __init__(self, cache: KVCache, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.cache = cache
        self.block_size = block_size
        self.num_complete = 0
        self.computed_blocks = 0  # blocks summarised from rows (not inserted from the store)
        self._summaries: dict[str, Tensor] = {}
        self._chunks: Tensor | None = None  # [L, kvh, capacity chunks, d] chunk mean rotated keys
        self._pending: list[Mapping[str, Tensor]] = []  # carried summaries not inserted yet (insert_later)
        self._variance: Tensor | None = None

    # -- writing ------------------------------------------------------------------------------------
    def _reserve(self, blocks: int) -> None:
        old = self._summaries.get("mean")
        have = 0 if old is None else old.shape[2]
        if blocks <= have:
            return
        c = self.cache
        size = max(blocks, c.capacity // self.block_size + 1, 2 * have)
        for kind in SUMMARY_KINDS:
            shape = (c.num_layers, c.num_kv_heads, size) + (() if kind == "sq" else (c.head_dim,))
            buffer = torch.zeros(shape, device=c.device)
            if have:
                buffer[:, :, :have] = self._summaries[kind]
            self._summaries[kind] = buffer

    def add_blocks(self, end_block: int | None = None) -> int:
        """Summarise blocks [num_complete, end_block) from the cache's rows (default: every block whose
        rows lie below ``cache.length``; the caller guarantees they are written at every layer).
        Returns how many blocks were summarised."""
        c = self.cache
        end = c.length // self.block_size if end_block is None else end_block
        if end * self.block_size > c.length:
            raise ValueError(f"block {end - 1} is not written yet (cache holds {c.length} rows)")
        start = self.num_complete
        if end <= start:
            return 0
        self._reserve(end)
        rows = slice(start * self.block_size, end * self.block_size)
        for layer in range(c.num_layers):
            parts = summarise_rows(
                c.k_pre[layer][:, rows], c.k_rot[layer][:, rows], self.block_size, c.kv_dtype
            )
            for kind, value in parts.items():
                self._summaries[kind][layer, :, start:end] = value
        self.num_complete = end
        self.computed_blocks += end - start
        self._update_chunks(start, end)
        return end - start

    def _update_chunks(self, start: int, end: int) -> None:
        """Recompute the chunk means of the chunks holding blocks [start, end)."""
        c = self.cache
        first, last = start // CHUNK_BLOCKS, (end - 1) // CHUNK_BLOCKS + 1
        size = self._summaries["rmean"].shape[2] // CHUNK_BLOCKS + 1
        if self._chunks is None or self._chunks.shape[2] < size:
            grown = torch.zeros(c.num_layers, c.num_kv_heads, size, c.head_dim, device=c.device)
            if self._chunks is not None:
                grown[:, :, : self._chunks.shape[2]] = self._chunks
            self._chunks = grown
        blocks = self._summaries["rmean"][:, :, first * CHUNK_BLOCKS : end]
        full = (end - first * CHUNK_BLOCKS) // CHUNK_BLOCKS
        if full:
            shape = (*blocks.shape[:2], full, CHUNK_BLOCKS, blocks.shape[-1])
            self._chunks[:, :, first : first + full] = (
                blocks[:, :, : full * CHUNK_BLOCKS].reshape(shape).mean(3)
            )
        if first + full < last:  # a chunk still filling
            self._chunks[:, :, first + full] = blocks[:, :, full * CHUNK_BLOCKS :].mean(2)

    def insert(self, summaries: Mapping[str, Tensor]) -> None:
        """Append the next block's summaries as a stored block carries them ({kind: [L, kvh, d]}, sq
        [L, kvh]); a ValueError if a kind is missing or misshapen (the caller then summarises the rows)."""
        self.insert_many([summaries])

    def insert_later(self, blocks: Sequence[Mapping[str, Tensor]]) -> None:
        """Keep the next blocks' summaries (as :meth:`insert_many` takes them) for :meth:`insert_pending`:
        a dense request's first token needs none of them."""
        self._pending = list(blocks)

    def insert_pending(self) -> int:
        """:meth:`insert_many` of the summaries kept by :meth:`insert_later` (once; nothing kept: 0)."""
        pending, self._pending = self._pending, []
        return self.insert_many(pending) if pending else 0

    def insert_many(self, blocks: Sequence[Mapping[str, Tensor]]) -> int:
        """Append the next blocks' summaries (each as :meth:`insert` takes them) in one write per kind;
        the valid leading ones are inserted and a ValueError names the first invalid one. Returns the
        number inserted."""
        c = self.cache
        valid = 0
        problem = None
        for summaries in blocks:
            for kind in SUMMARY_KINDS:
                want = (c.num_layers, c.num_kv_heads) + (() if kind == "sq" else (c.head_dim,))
                got = summaries.get(kind)
                if got is None or tuple(got.shape) != want:
                    problem = f"stored block summary {kind!r} is missing or not of shape {want}"
                    break
            if problem is not None:
                break
            valid += 1
        if valid:
            start = self.num_complete
            self._reserve(start + valid)
            for kind in SUMMARY_KINDS:
                stacked = torch.stack([blocks[i][kind] for i in range(valid)], dim=2)  # blocks on dim 2
                self._summaries[kind][:, :, start : start + valid] = stacked.to(self._summaries[kind].device)
            self.num_complete = start + valid
            self._update_chunks(start, start + valid)
        if problem is not None:
            raise ValueError(problem)
        return valid

    def block_summaries(self, block: int) -> dict[str, Tensor]:
        """The summaries of one complete block, in the KV dtype, as the store keeps them with the block."""
        if not 0 <= block < self.num_complete:
            raise ValueError(f"block {block} is not summarised (0..{self.num_complete - 1})")
        return {k: t[:, :, block].to(self.cache.kv_dtype).contiguous() for k, t in self._summaries.items()}

    def copy(self, cache: KVCache) -> BlockIndex:
        """An independent index over ``cache`` (a copy of this one's cache, e.g. a fork's)."""
        other = BlockIndex(cache, self.block_size)
        other.num_complete = self.num_complete
        other.computed_blocks = self.computed_blocks
        other._summaries = {k: t.clone() for k, t in self._summaries.items()}
        other._chunks = None if self._chunks is None else self._chunks.clone()
        other._pending = list(self._pending)
        return other

    # -- reading ------------------------------------------------------------------------------------
    def summary(self, kind: str) -> Tensor:
        """[L, kvh, nb, d] (``sq``: [L, kvh, nb]) of the complete blocks."""
        if kind not in SUMMARY_KINDS:
            raise ValueError(f"unknown summary {kind!r}; choose one of {SUMMARY_KINDS}")
        self._reserve(1)
        return self._summaries[kind][:, :, : self.num_complete]

    def chunk_means(self) -> Tensor:
        """[L, kvh, nc, d] mean rotated key of each chunk of :data:`CHUNK_BLOCKS` complete blocks (the
        last chunk: of the complete blocks it has so far)."""
        count = -(-self.num_complete // CHUNK_BLOCKS)
        if self._chunks is None:
            c = self.cache
            return torch.zeros(c.num_layers, c.num_kv_heads, 0, c.head_dim, device=c.device)
        return self._chunks[:, :, :count]

    def key_means(self) -> Tensor:
        """[L, kvh, nb, d] mean pre-RoPE key per complete block."""
        return self.summary("mean")

    def key_bounds(self) -> tuple[Tensor, Tensor]:
        """([L, kvh, nb, d] min, [L, kvh, nb, d] max) of rotated keys per complete block."""
        return self.summary("min"), self.summary("max")

    def head_variance(self) -> Tensor:
        """[L, kvh] variance of each KV head's pre-RoPE keys over the blocks complete at first call
        (from the blocks' means and mean squares: no key is read again)."""
        if self._variance is None:
            if self.num_complete == 0:
                raise ValueError("head_variance needs at least one complete block")
            mean = self.summary("mean").mean(dim=(2, 3))
            self._variance = self.summary("sq").mean(dim=2) - mean.square()
        return self._variance


@dataclass
class PrefillQueries:
    """Rotated queries of some prompt tokens, per layer, as the runtime computed them.

    q: layer -> [nh, n_l, d] float32 rotated queries (after every norm the family applies, e.g. Gemma 3's
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


def captured_offsets(total: int, window: int, stride: int, device: torch.device | str = "cpu") -> Tensor:
    """Offsets [n] (ascending, on ``device``) into ``total`` computed rows: every ``stride``-th from the end
    + the last ``window``. Worked out on the host from the three counts (no device round trip)."""
    ends = set(range(total - 1, -1, -stride)) if stride > 0 else set()
    last = set(range(max(0, total - window), total))
    return torch.tensor(sorted(ends | last), dtype=torch.long, device=device)


@contextlib.contextmanager
def capture_prefill_queries(cache: KVCache, window: int = 32, stride: int = 64) -> Iterator[PrefillQueries]:
    """Record the queries of the prefills run on ``cache`` inside the ``with`` block.

    Through the cache's ``query_observer`` (:meth:`semkv.models.runtime.Runtime.forward_rows`): at every
    layer the rotated queries of the computed rows, as the runtime used them. Of each layer's rows the
    last ``window`` and every ``stride``-th from the end are kept; a later prefill replaces an earlier
    one's rows.
    """
    result = PrefillQueries(window=window)

    def record(layer: int, queries: ObservedQueries) -> None:
        positions = queries.positions
        offsets = captured_offsets(positions.shape[0], window, stride, positions.device)
        result.q[layer] = queries.rotated(offsets).float()  # only the kept rows, in float32
        result.positions[layer] = positions[offsets].clone()

    previous = cache.query_observer
    cache.query_observer = record
    try:
        yield result
    finally:
        cache.query_observer = previous
    if result.positions:
        result.window = min(window, min(p.shape[0] for p in result.positions.values()))
