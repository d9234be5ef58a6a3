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
  the Jaccard similarity). The index persists under a folder (see :class:`PromptIndex`):
  generations of a snapshot plus an append-only journal of additions and removals (one
  checksummed JSON line each), shared safely by several processes through a file lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from semkv.config import private_mkdir
from semkv.validation import check_int, check_number

log = logging.getLogger(__name__)

MERSENNE_31 = (1 << 31) - 1
MAX_TABLES = 64
MAX_POSITION_FEATURES = 1024


# -- token signatures ------------------------------------------------------------------------------
@dataclass
class SimHashConfig:
    """Token-level SimHash.

    bits: hyperplanes per table (1..62); tables: independent tables (signature = tables x bits bits;
        at most ``MAX_TABLES``: the hyperplanes take (hidden + position_features) x tables x bits floats).
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
        check_int("bits", self.bits, 1, 62)
        check_int("tables", self.tables, 1, MAX_TABLES)
        check_number("position_weight", self.position_weight, 0.0, 1e3)
        check_int("position_features", self.position_features, 2, MAX_POSITION_FEATURES)
        if self.position_features % 2:
            raise ValueError(f"position_features must be even, got {self.position_features}")
        check_number("min_wavelength", self.min_wavelength, 0.0, 1e9, low_open=True)
        check_number("max_wavelength", self.max_wavelength, 0.0, 1e9, low_open=True)
        if self.min_wavelength > self.max_wavelength:
            raise ValueError("need min_wavelength <= max_wavelength")
        check_int("seed", self.seed, 0, 2**63 - 1)

    @property
    def total_bits(self) -> int:
        return self.bits * self.tables


def positional_features(positions: Tensor, config: SimHashConfig) -> Tensor:
    """positions [T] -> unit-norm sinusoid features [T, position_features] (float32)."""
    half = config.position_features // 2
    wavelengths = torch.logspace(
        math.log10(config.min_wavelength),
        math.log10(config.max_wavelength),
        half,
        dtype=torch.float64,
        device=positions.device,
    )
    angles = positions.to(torch.float64).unsqueeze(1) * (2 * math.pi / wavelengths).unsqueeze(0)
    feats = torch.cat([angles.sin(), angles.cos()], dim=1) / math.sqrt(half)
    return feats.float()


class TokenHasher:
    """SimHash of (centred, normalised embedding ; weighted positional features).

    center: [H] vector subtracted from every embedding (the vocabulary mean).
    The planes are drawn on the host from ``config.seed`` (the same planes on every device) and meet the
    embeddings on the embeddings' device.
    """

    def __init__(self, config: SimHashConfig, hidden_size: int, center: Tensor | None = None) -> None:
        self.config = config
        self.hidden_size = hidden_size
        self.center = (
            center.detach().float().reshape(hidden_size)
            if center is not None
            else torch.zeros(hidden_size, device="cpu")
        )
        generator = torch.Generator(device="cpu").manual_seed(config.seed)
        dim = hidden_size + config.position_features
        self.planes = torch.randn(dim, config.total_bits, generator=generator, device="cpu")

    def vectors(self, embeddings: Tensor, positions: Tensor) -> Tensor:
        """embeddings [T, H], positions [T] (on the embeddings' device) -> the hashed vectors
        [T, H + position_features]."""
        e = embeddings.detach().float() - self.center.to(embeddings.device)
        e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)
        p = positional_features(positions, self.config) * self.config.position_weight
        return torch.cat([e, p], dim=1)

    def bits(self, embeddings: Tensor, positions: Tensor) -> Tensor:
        """bool [T, tables * bits]."""
        return self.vectors(embeddings, positions) @ self.planes.to(embeddings.device) > 0

    def signatures(self, embeddings: Tensor, positions: Tensor) -> Tensor:
        """Packed signatures int64 [T, tables]."""
        return pack_bits(self.bits(embeddings, positions), self.config.bits)


def pack_bits(bits: Tensor, bits_per_table: int) -> Tensor:
    """bool [T, tables * bits] -> int64 [T, tables]."""
    t = bits.shape[0]
    weights = 1 << torch.arange(bits_per_table, dtype=torch.int64, device=bits.device)
    return (bits.view(t, -1, bits_per_table).to(torch.int64) * weights).sum(-1)


def unpack_bits(signatures: Tensor, bits_per_table: int) -> Tensor:
    """int64 [T, tables] -> bool [T, tables * bits] (inverse of :func:`pack_bits`)."""
    shifts = torch.arange(bits_per_table, dtype=torch.int64, device=signatures.device)
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

    **On disk** (``folder``), generation ``g`` is a snapshot ``snapshot.<g>.npz`` and the journal
    ``journal.<g>.jsonl`` of the records added after it (generation 0 keeps the names of the first
    format, ``snapshot.npz`` / ``journal.jsonl``), so ``snapshot.<g+1>`` = ``snapshot.<g>`` +
    ``journal.<g>``. Compaction writes generation ``g + 1`` (temp file, fsync, rename, folder fsync)
    and removes generation ``g - 1``; the previous generation is kept, so a damaged newest snapshot
    is recovered from the one before it plus both journals. A journal line is one checksummed
    record; a damaged or torn line is skipped (a torn line never swallows the record after it:
    appends start on a fresh line, and a record glued to a torn one is salvaged). A journal or
    snapshot write that fails (a full disk) is logged and counted in :attr:`write_errors`; the
    index keeps working in memory, and the records not journaled are appended with the next
    record that can be (at most ``MAX_UNWRITTEN`` are kept).

    **Several processes** may share one folder: every append and compaction holds an exclusive
    ``fcntl`` lock on ``.lock``, and before appending or compacting a process first reads the
    records the others appended, so a compaction never drops another process's records. Queries
    pick up the others' records at most every ``sync_interval_s`` seconds.
    """

    SNAPSHOT = "snapshot.npz"  # generation 0's names (the first format)
    JOURNAL = "journal.jsonl"
    LOCK = ".lock"
    TMP_PREFIX = ".tmp-"
    MAX_UNWRITTEN = 1024  # records kept in memory to retry while journal writes fail

    def __init__(
        self,
        config: IndexConfig | None = None,
        folder: str | Path | None = None,
        sync_interval_s: float = 1.0,
    ) -> None:
        self.config = config or IndexConfig()
        self.hasher = MinHasher(self.config)
        self.folder = Path(folder) if folder is not None else None
        self.sync_interval_s = sync_interval_s
        self.write_errors = 0  # journal / snapshot writes that failed (the index went on in memory)
        self.damaged_records = 0  # journal lines and snapshots skipped as damaged when read
        self._unwritten: list[bytes] = []  # journal lines whose append failed (retried with the next)
        self._config_tag = hashlib.sha256(
            json.dumps(asdict(self.config), sort_keys=True).encode()
        ).hexdigest()[:16]
        self._thread_lock = threading.RLock()
        self._lock_fd: int | None = None
        self._reset()
        if self.folder is not None:
            self._open()

    def _reset(self) -> None:
        self.keys: list[str] = []
        self.num_tokens: list[int] = []
        self._rows: dict[str, int] = {}
        self._sigs = np.zeros((0, self.config.num_hashes), dtype=np.uint32)
        self._count = 0
        self._buckets: list[dict[bytes, set[str]]] = [defaultdict(set) for _ in range(self.config.bands)]
        self._journal_records = 0  # records in the current generation's journal
        self._generation = 0
        self._offset = 0  # bytes of the current journal read so far
        self._journal_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the journal read
        self._last_sync = time.monotonic()

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

        def insert() -> bool:
            self._insert(key, sig, len(token_ids))
            return True

        self._mutate(insert, {"op": "add", "key": key, "n": len(token_ids), "sig": sig.tobytes().hex()})

    def remove(self, key: str) -> bool:
        """Forget a prompt (e.g. its KV left the store). Returns whether it was indexed."""
        return self._mutate(lambda: self._delete(key), {"op": "del", "key": key})

    def query(
        self, signature: np.ndarray, top: int = 1, min_similarity: float = 0.0, exclude: Sequence[str] = ()
    ) -> list[IndexHit]:
        """The ``top`` most similar indexed prompts sharing at least one band, best first."""
        with self._thread_lock:
            self._maybe_sync()
            return self._query(signature, top, min_similarity, exclude)

    def _query(
        self, signature: np.ndarray, top: int, min_similarity: float, exclude: Sequence[str]
    ) -> list[IndexHit]:
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

    # -- files -------------------------------------------------------------------------------------
    def _snapshot_path(self, generation: int) -> Path:
        assert self.folder is not None
        return self.folder / (self.SNAPSHOT if generation == 0 else f"snapshot.{generation}.npz")

    def _journal_path(self, generation: int) -> Path:
        assert self.folder is not None
        return self.folder / (self.JOURNAL if generation == 0 else f"journal.{generation}.jsonl")

    _GENERATION = re.compile(r"^(?:snapshot|journal)\.(\d+)\.(?:npz|jsonl)$")

    def _generations(self) -> list[int]:
        """Generations with a snapshot or a journal on disk, ascending (0 when there are none)."""
        assert self.folder is not None
        found = {0}
        for path in self.folder.iterdir():
            match = self._GENERATION.match(path.name)
            if match:
                found.add(int(match.group(1)))
        return sorted(found)

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """This thread alone in the index, and the folder's file lock (shared or exclusive)."""
        with self._thread_lock:
            assert self._lock_fd is not None
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _open(self) -> None:
        assert self.folder is not None
        try:
            private_mkdir(self.folder)
            self._lock_fd = os.open(self.folder / self.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            log.warning(
                "share index folder %s is unusable (%s); keeping the index in memory only", self.folder, exc
            )
            self.folder = None
            return
        with self._locked(exclusive=True):
            self._sweep_temp_files()  # temp files only exist while their writer holds the exclusive lock
            self._load()

    def _sweep_temp_files(self) -> None:
        assert self.folder is not None
        for stale in self.folder.glob(f"{self.TMP_PREFIX}*"):
            stale.unlink(missing_ok=True)

    def close(self) -> None:
        """Release the folder's lock file (the index stays usable in memory)."""
        with self._thread_lock:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            self.folder = None

    # -- loading -----------------------------------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the in-memory index from the newest readable snapshot plus every later journal."""
        self._reset()
        generations = self._generations()
        base = None
        for generation in reversed(generations):
            if self._snapshot_path(generation).exists() and self._load_snapshot(generation):
                base = generation
                break
            self._reset()
        later = [g for g in generations if base is None or g >= base]
        for generation in later:
            self._journal_records = 0
            self._offset = 0
            self._journal_id = None
            self._read_journal(generation)
        self._generation = max(generations)
        if self._generation not in later:
            self._journal_records, self._offset, self._journal_id = 0, 0, None
        self._last_sync = time.monotonic()

    def _load_snapshot(self, generation: int) -> bool:
        path = self._snapshot_path(generation)
        try:
            with np.load(path) as data:
                stored = json.loads(data["config"].tobytes().decode())
                if stored != asdict(self.config):
                    log.warning("share index snapshot %s was built with other settings; not used", path)
                    return False
                keys, counts, sigs = data["keys"], data["num_tokens"], data["sigs"]
                if not (len(keys) == len(counts) == len(sigs)) or (
                    len(sigs) and sigs.shape[1:] != (self.config.num_hashes,)
                ):
                    raise ValueError("arrays of inconsistent shapes")
                for key, n, sig in zip(keys, counts, sigs, strict=True):
                    self._insert(str(key), sig, int(n))
        except Exception as exc:  # a damaged zip raises BadZipFile, zlib.error, EOFError, ValueError, ...
            self.damaged_records += 1
            log.warning(
                "unreadable share index snapshot %s (%s: %s); using the one before",
                path,
                type(exc).__name__,
                exc,
            )
            return False
        return True

    def _read_journal(self, generation: int) -> None:
        """Apply the records of journal ``generation`` from ``self._offset`` on (whole lines only)."""
        path = self._journal_path(generation)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._journal_id not in (None, (st.st_dev, st.st_ino)) or st.st_size < self._offset:
                    self._offset = 0  # another journal under this name: read it from the start
                    self._journal_records = 0
                self._journal_id = (st.st_dev, st.st_ino)
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot read share index journal %s: %s", path, exc)
            return
        end = data.rfind(b"\n") + 1  # a last line without its newline may still be being written
        bad = 0
        for line in data[:end].split(b"\n"):
            if line.strip():
                bad += not self._apply_line(line)
        self._offset += end
        if bad:
            self.damaged_records += bad
            log.warning("skipped %d damaged record(s) in %s", bad, path)

    def _apply_line(self, line: bytes) -> bool:
        """Apply one journal line; a line whose start is torn may still end with a whole record."""
        if self._apply_record(line):
            return True
        glued = line.rfind(b'{"crc"', 1)
        if glued > 0:
            self._apply_record(line[glued:])  # the record written after a torn one, on its line
        return False  # the torn part is damage either way

    def _apply_record(self, line: bytes) -> bool:
        try:
            wrapper = json.loads(line)
            if zlib.crc32(wrapper["r"].encode()) != wrapper["crc"]:
                raise ValueError("checksum mismatch")
            record = json.loads(wrapper["r"])
            if record.get("cfg", self._config_tag) != self._config_tag:
                return True  # a record of an index built with other settings: not ours, not damage
            if record["op"] == "add":
                sig = np.frombuffer(bytes.fromhex(record["sig"]), dtype=np.uint32)
                if sig.shape != (self.config.num_hashes,):
                    raise ValueError("signature length")
                self._insert(str(record["key"]), sig, int(record["n"]))
            elif record["op"] == "del":
                self._delete(str(record["key"]))
            else:
                raise ValueError(f"unknown op {record['op']!r}")
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        self._journal_records += 1
        return True

    def _catch_up(self) -> None:
        """Read what other processes wrote since this one last looked (call with the file lock held)."""
        newest = max(self._generations())  # listed, not probed: g+1 may be gone after several compactions
        if newest != self._generation:
            self._load()  # another process compacted: reload from its snapshot
            for line in self._unwritten:  # and keep this process's records not on disk yet
                self._apply_record(line)
        else:
            self._read_journal(self._generation)
        self._last_sync = time.monotonic()

    def _maybe_sync(self) -> None:
        if self.folder is None or time.monotonic() - self._last_sync < self.sync_interval_s:
            return
        self.sync()

    def sync(self) -> None:
        """Pick up the records other processes sharing the folder wrote."""
        if self.folder is None:
            return
        with self._locked(exclusive=False):
            try:
                self._catch_up()
            except OSError as exc:
                log.warning("cannot read the share index at %s: %s", self.folder, exc)

    # -- writing -----------------------------------------------------------------------------------
    def _mutate(self, apply: Callable[[], bool], record: dict) -> bool:
        """Apply a change in memory and journal it (when ``apply`` changed something).

        Persistent: under the exclusive lock, first read what other processes appended (a reload, if
        one compacted), then apply, then append — so memory never loses the change to a reload, and
        the journal's order is the order the changes were made in.
        """
        with self._thread_lock:
            if self.folder is None:
                return apply()
            with self._locked(exclusive=True):
                try:
                    self._catch_up()
                except OSError as exc:
                    log.warning("cannot read the share index at %s: %s", self.folder, exc)
                changed = apply()
                if changed:
                    self._journal(record)
                return changed

    def _journal(self, record: dict) -> None:
        """Append ``record`` (the caller holds the exclusive lock and caught up); compact when due."""
        record = {**record, "cfg": self._config_tag}
        body = json.dumps(record, sort_keys=True)
        line = (json.dumps({"crc": zlib.crc32(body.encode()), "r": body}) + "\n").encode()
        self._unwritten.append(line)
        del self._unwritten[: -self.MAX_UNWRITTEN]
        try:
            self._append(b"".join(self._unwritten))
        except OSError as exc:
            self.write_errors += 1
            log.warning(
                "cannot journal a share index record in %s (%s); %d record(s) kept to retry",
                self.folder,
                exc,
                len(self._unwritten),
            )
            return
        self._journal_records += len(self._unwritten)
        self._unwritten.clear()
        if self._journal_records >= self.config.compact_every:
            self._compact()

    def _append(self, line: bytes) -> None:
        """Append one record line (after a newline if a torn line is left at the end); fsynced."""
        path = self._journal_path(self._generation)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
                line = b"\n" + line
            if (st.st_dev, st.st_ino) != self._journal_id:
                self._journal_id, self._offset = (st.st_dev, st.st_ino), 0
            os.write(fd, line)
            os.fsync(fd)
            self._offset = st.st_size + len(line)
        finally:
            os.close(fd)

    def flush(self) -> None:
        """Compact: write the whole index as the next generation's snapshot (the journal starts empty)."""
        if self.folder is None:
            return
        with self._locked(exclusive=True):
            self._catch_up()
            self._compact()

    def _compact(self) -> None:
        """Write generation ``g + 1`` from memory (up to date: the caller caught up under the lock)."""
        assert self.folder is not None
        nxt = self._generation + 1
        fd, tmp = tempfile.mkstemp(prefix=self.TMP_PREFIX, suffix=".npz", dir=self.folder)
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
            os.replace(tmp, self._snapshot_path(nxt))
            _fsync_folder(self.folder)
        except OSError as exc:
            self.write_errors += 1
            log.warning(
                "cannot write a share index snapshot in %s (%s); the journal goes on", self.folder, exc
            )
            return
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for old in (self._snapshot_path(nxt - 2), self._journal_path(nxt - 2)) if nxt >= 2 else ():
            try:
                old.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove old share index file %s: %s", old, exc)
        self._generation = nxt
        self._journal_records = 0
        self._offset = 0
        self._journal_id = None


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
