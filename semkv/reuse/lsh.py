"""Locality-sensitive hashing for SemShareKV: token signatures and the reference index.

Two levels:

* **Token signatures** (:class:`TokenHasher`): random-hyperplane SimHash over each
  token's input embedding (centred on the vocabulary mean, so the common direction
  every embedding shares does not swamp the hash) concatenated with a positional
  component (sinusoids of long wavelengths, weighted by ``position_weight``), so two
  tokens agree on many bits when their embeddings point the same way *and* they sit
  at nearby positions. ``tables`` x ``bits`` bits per token, packed into one int64
  per table. Bit agreement between two tokens estimates the angle between their
  combined vectors (SimHash: P[bit equal] = 1 - angle / pi).

* **Reference index** (:class:`PromptIndex`): finds the stored prompt most similar
  to a new one without scanning every stored prompt. A prompt-level signature is a
  MinHash over the set of token n-grams (Jaccard similarity of n-gram sets); the
  signature is cut into bands and every band is a key into a bucket table (classic
  banded LSH), so a query only touches prompts that share at least one whole band.
  Candidates are re-ranked by the fraction of equal MinHash values (an estimate of
  the Jaccard similarity). The index persists under a folder: a snapshot written
  atomically (temp file, fsync, rename) plus an append-only journal of additions
  and removals (one checksummed JSON line each; a torn last line is ignored),
  folded into a new snapshot every ``compact_every`` records.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger(__name__)

MERSENNE_31 = (1 << 31) - 1


# -- token signatures ------------------------------------------------------------------------------
@dataclass
class SimHashConfig:
    """Token-level SimHash.

    bits: hyperplanes per table (1..62); tables: independent tables (signature = tables x bits bits).
    position_weight: weight of the positional component relative to the (unit) embedding part;
        0 = position-blind. position_features: number of sinusoid features (even).
    min_wavelength / max_wavelength: wavelengths (in tokens) of the positional sinusoids; tokens
        closer than ~min_wavelength / 10 look positionally alike, tokens ~max_wavelength apart do not.
    seed: seeds the hyperplanes (the same seed must hash stored and new prompts).
    """

    bits: int = 16
    tables: int = 4
    position_weight: float = 0.5
    position_features: int = 16
    min_wavelength: float = 64.0
    max_wavelength: float = 8192.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 62:
            raise ValueError(f"bits must be in [1, 62], got {self.bits}")
        if self.tables < 1:
            raise ValueError(f"tables must be >= 1, got {self.tables}")
        if self.position_weight < 0:
            raise ValueError(f"position_weight must be >= 0, got {self.position_weight}")
        if self.position_features < 2 or self.position_features % 2:
            raise ValueError(f"position_features must be even and >= 2, got {self.position_features}")
        if not 0 < self.min_wavelength <= self.max_wavelength:
            raise ValueError("need 0 < min_wavelength <= max_wavelength")

    @property
    def total_bits(self) -> int:
        return self.bits * self.tables


def positional_features(positions: Tensor, config: SimHashConfig) -> Tensor:
    """positions [T] -> unit-norm sinusoid features [T, position_features] (float32)."""
    half = config.position_features // 2
    wavelengths = torch.logspace(
        math.log10(config.min_wavelength), math.log10(config.max_wavelength), half, dtype=torch.float64
    )
    angles = positions.to(torch.float64).unsqueeze(1) * (2 * math.pi / wavelengths).unsqueeze(0)
    feats = torch.cat([angles.sin(), angles.cos()], dim=1) / math.sqrt(half)
    return feats.float()


class TokenHasher:
    """SimHash of (centred, normalised embedding ; weighted positional features).

    center: [H] vector subtracted from every embedding (the vocabulary mean).
    """

    def __init__(self, config: SimHashConfig, hidden_size: int, center: Tensor | None = None) -> None:
        self.config = config
        self.hidden_size = hidden_size
        self.center = (
            center.detach().float().reshape(hidden_size) if center is not None else torch.zeros(hidden_size)
        )
        generator = torch.Generator().manual_seed(config.seed)
        dim = hidden_size + config.position_features
        self.planes = torch.randn(dim, config.total_bits, generator=generator)

    def vectors(self, embeddings: Tensor, positions: Tensor) -> Tensor:
        """embeddings [T, H], positions [T] -> the hashed vectors [T, H + position_features]."""
        e = embeddings.detach().float() - self.center
        e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)
        p = positional_features(positions, self.config) * self.config.position_weight
        return torch.cat([e, p], dim=1)

    def bits(self, embeddings: Tensor, positions: Tensor) -> Tensor:
        """bool [T, tables * bits]."""
        return self.vectors(embeddings, positions) @ self.planes > 0

    def signatures(self, embeddings: Tensor, positions: Tensor) -> Tensor:
        """Packed signatures int64 [T, tables]."""
        return pack_bits(self.bits(embeddings, positions), self.config.bits)


def pack_bits(bits: Tensor, bits_per_table: int) -> Tensor:
    """bool [T, tables * bits] -> int64 [T, tables]."""
    t = bits.shape[0]
    weights = 1 << torch.arange(bits_per_table, dtype=torch.int64)
    return (bits.view(t, -1, bits_per_table).to(torch.int64) * weights).sum(-1)


def unpack_bits(signatures: Tensor, bits_per_table: int) -> Tensor:
    """int64 [T, tables] -> bool [T, tables * bits] (inverse of :func:`pack_bits`)."""
    shifts = torch.arange(bits_per_table, dtype=torch.int64)
    return ((signatures.unsqueeze(-1) >> shifts) & 1).bool().reshape(signatures.shape[0], -1)


def bit_agreement(a: Tensor, b: Tensor) -> Tensor:
    """Fraction of equal bits between every row of a [n, B] and b [m, B] (bool) -> [n, m] float32."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"signatures of {a.shape[1]} and {b.shape[1]} bits cannot be compared")
    sa = a.float() * 2 - 1
    sb = b.float() * 2 - 1
    return (sa @ sb.T + a.shape[1]) / (2 * a.shape[1])


# -- prompt-level MinHash --------------------------------------------------------------------------
@dataclass
class IndexConfig:
    """The reference index.

    num_hashes: MinHash values per prompt; bands: LSH bands (must divide num_hashes). With r =
        num_hashes / bands rows per band, a prompt of Jaccard similarity s becomes a candidate
        with probability 1 - (1 - s^r)^bands (64 / 32: 0.96 at s = 0.3, 0.08 at s = 0.05).
    shingle: token n-gram length of the set elements.
    max_candidates: candidates re-ranked per query (the most frequently colliding first).
    compact_every: journal records folded into a new snapshot.
    seed: seeds the MinHash permutations.
    """

    num_hashes: int = 64
    bands: int = 32
    shingle: int = 2
    max_candidates: int = 256
    compact_every: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_hashes < 1 or self.bands < 1 or self.num_hashes % self.bands:
            raise ValueError(f"bands ({self.bands}) must divide num_hashes ({self.num_hashes})")
        if self.shingle < 1:
            raise ValueError(f"shingle must be >= 1, got {self.shingle}")
        if self.max_candidates < 1 or self.compact_every < 1:
            raise ValueError("max_candidates and compact_every must be >= 1")

    @property
    def rows(self) -> int:
        return self.num_hashes // self.bands


class MinHasher:
    """MinHash of a token sequence's n-gram set: uint32 [num_hashes] (hash h_i(x) = (a_i x + b_i) mod p)."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        rng = np.random.default_rng(config.seed)
        self.a = rng.integers(1, MERSENNE_31, size=config.num_hashes, dtype=np.uint64)
        self.b = rng.integers(0, MERSENNE_31, size=config.num_hashes, dtype=np.uint64)

    def shingles(self, token_ids: Sequence[int]) -> np.ndarray:
        """Distinct n-gram codes in [0, 2^31 - 1) (uint64 [S])."""
        ids = np.asarray(token_ids, dtype=np.uint64)
        n = self.config.shingle
        if ids.size < n:
            n = max(1, int(ids.size))
        code = np.zeros(max(0, ids.size - n + 1), dtype=np.uint64)
        for offset in range(n):  # polynomial rolling code, wrapping mod 2^64
            code = code * np.uint64(1_000_003) + ids[offset : offset + code.size] + np.uint64(1)
        return np.unique(code % np.uint64(MERSENNE_31))

    def signature(self, token_ids: Sequence[int]) -> np.ndarray:
        codes = self.shingles(token_ids)
        if codes.size == 0:
            return np.full(self.config.num_hashes, MERSENNE_31, dtype=np.uint32)
        hashed = (np.outer(codes, self.a) + self.b) % np.uint64(MERSENNE_31)  # [S, k], < 2^62: no overflow
        return hashed.min(axis=0).astype(np.uint32)


def jaccard_estimate(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Fraction of equal MinHash values: a [k] vs b [..., k] -> [...]."""
    return (b == a).mean(axis=-1)


# -- the index --------------------------------------------------------------------------------------
@dataclass
class IndexHit:
    key: str
    similarity: float  # estimated Jaccard similarity of the n-gram sets
    num_tokens: int


class PromptIndex:
    """Banded MinHash LSH over stored prompts; persistent when given a folder.

    Row ``i`` of the signature matrix belongs to ``keys[i]``; removal swaps the last row
    in, so every operation is O(bands) plus the re-ranking of the candidates.
    """

    SNAPSHOT = "snapshot.npz"
    JOURNAL = "journal.jsonl"

    def __init__(self, config: IndexConfig | None = None, folder: str | Path | None = None) -> None:
        self.config = config or IndexConfig()
        self.hasher = MinHasher(self.config)
        self.folder = Path(folder) if folder is not None else None
        self._reset()
        if self.folder is not None:
            self._load()

    def _reset(self) -> None:
        self.keys: list[str] = []
        self.num_tokens: list[int] = []
        self._rows: dict[str, int] = {}
        self._sigs = np.zeros((0, self.config.num_hashes), dtype=np.uint32)
        self._count = 0
        self._buckets: list[dict[bytes, set[str]]] = [defaultdict(set) for _ in range(self.config.bands)]
        self._journal_records = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    # -- signatures ----------------------------------------------------------------------------
    def signature(self, token_ids: Sequence[int]) -> np.ndarray:
        return self.hasher.signature(token_ids)

    def _band_keys(self, sig: np.ndarray) -> list[bytes]:
        r = self.config.rows
        return [sig[i * r : (i + 1) * r].tobytes() for i in range(self.config.bands)]

    # -- mutation (in memory) ------------------------------------------------------------------
    def _insert(self, key: str, sig: np.ndarray, num_tokens: int) -> None:
        if key in self._rows:
            self._delete(key)
        if self._count == self._sigs.shape[0]:
            grown = np.zeros((max(64, 2 * self._count), self.config.num_hashes), dtype=np.uint32)
            grown[: self._count] = self._sigs[: self._count]
            self._sigs = grown
        self._sigs[self._count] = sig
        self._rows[key] = self._count
        self.keys.append(key)
        self.num_tokens.append(int(num_tokens))
        self._count += 1
        for band, bkey in enumerate(self._band_keys(sig)):
            self._buckets[band][bkey].add(key)

    def _delete(self, key: str) -> bool:
        row = self._rows.pop(key, None)
        if row is None:
            return False
        sig = self._sigs[row].copy()
        for band, bkey in enumerate(self._band_keys(sig)):
            bucket = self._buckets[band].get(bkey)
            if bucket is not None:
                bucket.discard(key)
                if not bucket:
                    del self._buckets[band][bkey]
        last = self._count - 1
        if row != last:
            moved = self.keys[last]
            self._sigs[row] = self._sigs[last]
            self.keys[row] = moved
            self.num_tokens[row] = self.num_tokens[last]
            self._rows[moved] = row
        self.keys.pop()
        self.num_tokens.pop()
        self._count = last
        return True

    # -- public API ------------------------------------------------------------------------------
    def add(self, key: str, token_ids: Sequence[int], signature: np.ndarray | None = None) -> None:
        """Remember a prompt (replacing an earlier record of the same key); journaled when persistent."""
        sig = self.signature(token_ids) if signature is None else np.asarray(signature, dtype=np.uint32)
        if sig.shape != (self.config.num_hashes,):
            raise ValueError(f"signature of shape {sig.shape}; expected ({self.config.num_hashes},)")
        self._insert(key, sig, len(token_ids))
        self._journal({"op": "add", "key": key, "n": len(token_ids), "sig": sig.tobytes().hex()})

    def remove(self, key: str) -> bool:
        """Forget a prompt (e.g. its KV left the store). Returns whether it was indexed."""
        removed = self._delete(key)
        if removed:
            self._journal({"op": "del", "key": key})
        return removed

    def query(
        self, signature: np.ndarray, top: int = 1, min_similarity: float = 0.0, exclude: Sequence[str] = ()
    ) -> list[IndexHit]:
        """The ``top`` most similar indexed prompts sharing at least one band, best first."""
        hits: dict[str, int] = defaultdict(int)
        for band, bkey in enumerate(self._band_keys(np.asarray(signature, dtype=np.uint32))):
            for key in self._buckets[band].get(bkey, ()):
                hits[key] += 1
        for key in exclude:
            hits.pop(key, None)
        if not hits:
            return []
        ranked = sorted(hits, key=hits.__getitem__, reverse=True)[: self.config.max_candidates]
        rows = np.fromiter((self._rows[k] for k in ranked), dtype=np.int64, count=len(ranked))
        sims = jaccard_estimate(np.asarray(signature, dtype=np.uint32), self._sigs[rows])
        order = np.argsort(-sims, kind="stable")[:top]
        return [
            IndexHit(ranked[i], float(sims[i]), self.num_tokens[rows[i]])
            for i in order
            if sims[i] >= min_similarity
        ]

    # -- persistence -----------------------------------------------------------------------------
    def _journal(self, record: dict) -> None:
        if self.folder is None:
            return
        body = json.dumps(record, sort_keys=True)
        line = json.dumps({"crc": zlib.crc32(body.encode()), "r": body}) + "\n"
        with open(self.folder / self.JOURNAL, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._journal_records += 1
        if self._journal_records >= self.config.compact_every:
            self.flush()

    def flush(self) -> None:
        """Write a snapshot of the whole index atomically and empty the journal."""
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    config=np.frombuffer(json.dumps(asdict(self.config)).encode(), dtype=np.uint8),
                    keys=np.asarray(self.keys, dtype="U64"),
                    num_tokens=np.asarray(self.num_tokens, dtype=np.int64),
                    sigs=self._sigs[: self._count],
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.folder / self.SNAPSHOT)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        journal = self.folder / self.JOURNAL
        if journal.exists():  # snapshot first, then the journal: a crash between the two replays no-ops
            os.replace(self._empty_file(), journal)
        self._journal_records = 0

    def _empty_file(self) -> str:
        assert self.folder is not None
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.folder)
        os.close(fd)
        return tmp

    def _load(self) -> None:
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(".tmp-*"):
            stale.unlink(missing_ok=True)
        snapshot = self.folder / self.SNAPSHOT
        if snapshot.exists():
            try:
                with np.load(snapshot) as data:
                    stored = json.loads(data["config"].tobytes().decode())
                    if stored != asdict(self.config):
                        log.warning(
                            "share index at %s was built with other settings; starting empty", snapshot
                        )
                        snapshot.unlink()
                        (self.folder / self.JOURNAL).unlink(missing_ok=True)
                        return
                    for key, n, sig in zip(data["keys"], data["num_tokens"], data["sigs"], strict=True):
                        self._insert(str(key), sig, int(n))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("unreadable share index snapshot %s (%s); starting empty", snapshot, exc)
                self._reset()
        self._replay_journal()

    def _replay_journal(self) -> None:
        assert self.folder is not None
        journal = self.folder / self.JOURNAL
        if not journal.exists():
            return
        bad = 0
        for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                wrapper = json.loads(line)
                if zlib.crc32(wrapper["r"].encode()) != wrapper["crc"]:
                    raise ValueError("checksum mismatch")
                record = json.loads(wrapper["r"])
                if record["op"] == "add":
                    sig = np.frombuffer(bytes.fromhex(record["sig"]), dtype=np.uint32)
                    if sig.shape != (self.config.num_hashes,):
                        raise ValueError("signature length")
                    self._insert(record["key"], sig, int(record["n"]))
                elif record["op"] == "del":
                    self._delete(record["key"])
                self._journal_records += 1
            except (ValueError, KeyError, TypeError):
                bad += 1
        if bad:
            log.warning("ignored %d damaged record(s) in %s", bad, journal)
