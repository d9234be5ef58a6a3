"""SemShareKV: serve a prompt from the KV cache of the most similar earlier prompt.

Remember (``after_prefill``): every exactly prefilled prompt of at least
``min_tokens`` tokens is stored as an ``EntryKind.PROMPT`` entry (pre-RoPE K/V of
every token, its token SimHash signatures as the extra ``"lsh"``) and added to the
reference index (:class:`semkv.reuse.lsh.PromptIndex`, MinHash + banded LSH over
token bigrams, persisted under the folder the engine gives: ``<home>/share_index/<fingerprint>``).
The index and the token hashers are state of one :class:`SharePath` instance, which one engine owns.

**One index per namespace.** A request's namespace (tenant + cache salt) picks its index: the
default namespace's lives in the folder itself, any other in ``<folder>/ns/<namespace folder>``,
and prompt keys are scoped by the namespace too, so a prompt of one tenant is never a reference
for another (similarity, not equality, is enough for SemShareKV to leak a prompt: every namespace
must have its own references). At most ``max_open_indexes`` non-default indexes stay open (LRU);
the token hashers of at most ``MAX_HASHERS`` distinct signature settings are kept (LRU).

Plan: find the most similar stored prompt in the index (refuse at once if none is
similar enough: the plan is cheap when nothing similar exists), then match every
new token to a reference token:

1. aligned runs of identical token ids (n-gram anchors, the candidate nearest the
   current alignment offset wins, runs are extended token by token);
2. the same token id elsewhere in the reference (the nearest position);
3. the nearest token signature (SimHash of embedding + position) if its bit
   agreement reaches ``min_token_similarity``;
4. otherwise unmatched.

Below ``min_match_rate`` (share of tokens matched in aligned runs: the only matches
whose context is the reference's) the path is refused with the reason.

Prefill: the leading tokens identical to the reference's are exact and loaded as
they are; the rest get the reference K/V gathered in the new order, layer by layer
straight into the cache, and re-rotated to their new positions (:meth:`Runtime.load_pieces`
with a :meth:`RowSource.gathered` piece), and one :meth:`Runtime.forward_rows` pass with
the shared :class:`SelectiveRecompute` (the mechanism CacheBlend uses) recomputes, at layer 0,
the rows near a change in the alignment (:func:`near_breaks`, ``ShareConfig.layer0_window``; every
row with a window of 0, as in the paper), unmatched tokens and the last token always, and from
layer 1 on the matched tokens among them whose fresh KV deviates most from the reused KV, a
fraction that decays with depth (exponential by default, as in the paper; constant as an option).
Rows far from any change keep the reference's KV at every layer. ``unmatched="drop"`` is
the paper's "elimination" baseline: unmatched tokens are left out of the cache instead of
being recomputed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from semkv.models.cache import KVCache
from semkv.models.staging import RowSource
from semkv.prompt import PromptLayout
from semkv.reuse.base import Plan, PrefillContext, PrefillOutcome, Refusal
from semkv.reuse.lsh import (
    IndexConfig,
    PromptIndex,
    SimHashConfig,
    TokenHasher,
    bit_agreement,
    pack_bits,
    unpack_bits,
)
from semkv.reuse.options import ReuseOptions, ShareConfig
from semkv.reuse.selective import SelectiveRecompute, deviation_recompute
from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKind, Namespace, prompt_key

log = logging.getLogger(__name__)

UNMATCHED, ALIGNED, SAME_TOKEN, SIGNATURE = 0, 1, 2, 3
LSH_EXTRA = "lsh"
MAX_HASHERS = 4
NAMESPACES_DIR = "ns"


# -- matching (pure functions over token ids and signature bits) ------------------------------------
@dataclass
class TokenMatch:
    """source: int64 [n] reference row of every new token (-1 = unmatched);
    kind: int8 [n] (UNMATCHED / ALIGNED / SAME_TOKEN / SIGNATURE);
    exact_prefix: leading tokens identical to the reference's at the same positions."""

    source: np.ndarray
    kind: np.ndarray
    exact_prefix: int

    @property
    def num_tokens(self) -> int:
        return int(self.source.size)

    @property
    def matched(self) -> int:
        return int((self.kind != UNMATCHED).sum())

    @property
    def match_rate(self) -> float:
        return self.matched / max(1, self.num_tokens)

    @property
    def aligned_rate(self) -> float:
        return int((self.kind == ALIGNED).sum()) / max(1, self.num_tokens)

    def counts(self) -> dict[str, int]:
        return {
            "aligned": int((self.kind == ALIGNED).sum()),
            "same_token": int((self.kind == SAME_TOKEN).sum()),
            "signature": int((self.kind == SIGNATURE).sum()),
            "unmatched": int((self.kind == UNMATCHED).sum()),
        }


def exact_prefix_length(new_ids: Sequence[int] | np.ndarray, ref_ids: Sequence[int] | np.ndarray) -> int:
    """Leading tokens of ``new_ids`` equal to ``ref_ids``' at the same positions."""
    a, b = as_ids(new_ids), as_ids(ref_ids)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as an int64 array [n] (no copy when they already are one)."""
    return np.asarray(ids, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class AnchorTable:
    """Where each ``anchor``-gram of the new prompt occurs in the reference (exact n-gram equality).

    group: int64 [n - anchor + 1] per new position, the id of its n-gram (-1: not in the reference);
    starts: int64 [G + 1] CSR offsets into ``positions``; positions: int64 reference positions of every
    group, ascending within a group.
    """

    group: np.ndarray
    starts: np.ndarray
    positions: np.ndarray

    @classmethod
    def build(cls, new: np.ndarray, ref: np.ndarray, anchor: int) -> AnchorTable:
        """new [n], ref [m] int64 token ids. One sort over both prompts' n-grams (rows compared whole)."""
        n_new, n_ref = max(0, new.size - anchor + 1), max(0, ref.size - anchor + 1)
        if n_new == 0 or n_ref == 0:
            return cls(np.full(n_new, -1, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))
        grams = np.concatenate(
            [
                np.lib.stride_tricks.sliding_window_view(ref, anchor),
                np.lib.stride_tricks.sliding_window_view(new, anchor),
            ]
        )
        inverse = group_rows(grams)
        ref_group, new_group = inverse[:n_ref], inverse[n_ref:]
        order = np.argsort(ref_group, kind="stable")  # by group, positions ascending within one
        counts = np.bincount(ref_group, minlength=int(inverse.max()) + 1)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        group = np.where(counts[new_group] > 0, new_group, -1).astype(np.int64)
        return cls(group, starts, order.astype(np.int64))

    def nearest(self, i: int, want: int) -> int | None:
        """The reference position of new position ``i``'s n-gram nearest ``want`` (the lower on a tie);
        None when the n-gram is not in the reference (or ``i`` starts none)."""
        if i >= self.group.size or self.group[i] < 0:
            return None
        g = int(self.group[i])
        hits = self.positions[self.starts[g] : self.starts[g + 1]]
        at = int(np.searchsorted(hits, want, side="left"))
        if at == 0:
            return int(hits[0])
        if at == hits.size:
            return int(hits[-1])
        lo, hi = int(hits[at - 1]), int(hits[at])
        return lo if want - lo <= hi - want else hi


def group_rows(rows: np.ndarray) -> np.ndarray:
    """int64 [N] group id of every row of ``rows`` [N, k] (equal rows, equal ids; ids 0..G-1 in sorted
    order of the rows): one lexicographic sort of the columns (faster than ``np.unique(axis=0)``)."""
    if rows.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    low, high = int(rows.min()), int(rows.max())
    width = max(1, (high - low).bit_length())
    if low >= 0 and width * rows.shape[1] <= 64:  # every row packed exactly into one uint64
        code = np.zeros(rows.shape[0], dtype=np.uint64)
        for column in range(rows.shape[1]):
            code = (code << np.uint64(width)) | (rows[:, column] - low).astype(np.uint64)
        order = np.argsort(code, kind="stable")
        ordered = code[order]
        starts = np.ones(order.size, dtype=bool)
        starts[1:] = ordered[1:] != ordered[:-1]
    else:
        order = np.lexsort(rows.T[::-1])
        ordered = rows[order]
        starts = np.ones(order.size, dtype=bool)
        starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    inverse = np.empty(order.size, dtype=np.int64)
    inverse[order] = np.cumsum(starts) - 1
    return inverse


def _first_true(flags: Callable[[int, int], np.ndarray], start: int, end: int) -> int:
    """The first index in [start, end) where ``flags(a, b)`` (bool [b - a] for [a, b)) is True, else end.
    Scans in doubling windows, so a short run costs a short scan."""
    width = 32
    while start < end:
        stop = min(end, start + width)
        hit = np.flatnonzero(flags(start, stop))
        if hit.size:
            return start + int(hit[0])
        start, width = stop, width * 2
    return end


def align_runs(
    new_ids: Sequence[int] | np.ndarray, ref_ids: Sequence[int] | np.ndarray, anchor: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Match tokens in runs of identical ids. Returns (source [n] with -1 for unmatched,
    expected [n]: the reference position the current alignment predicts for each token).

    A run starts at an n-gram (``anchor`` tokens) that also occurs in the reference —
    the occurrence nearest the current alignment offset — and extends while the next
    tokens agree. After a mismatch the offset is kept, so a substituted token does not
    lose the alignment of the tokens after it.

    The greedy walk is the token-by-token one (token ``i`` continues the current diagonal
    ``i + offset`` if the ids agree; else an anchor at ``i`` moves the diagonal; else ``i`` is
    unmatched), but it steps from event to event: a run along the diagonal and a stretch of
    unmatched tokens are each found with array operations, so Python runs once per run, not
    once per token.
    """
    new, ref = as_ids(new_ids), as_ids(ref_ids)
    n, m = new.size, ref.size
    table = AnchorTable.build(new, ref, anchor)
    has_anchor = table.group >= 0  # [n - anchor + 1]
    source = np.full(n, -1, dtype=np.int64)
    expected = np.zeros(n, dtype=np.int64)
    offset, i = 0, 0

    def on_diagonal(a: int, b: int) -> np.ndarray:
        """[b - a] bool: new[k] == ref[k + offset] (False where k + offset is outside the reference)."""
        out = np.zeros(b - a, dtype=bool)
        lo, hi = max(a, -offset), min(b, m - offset)
        if lo < hi:
            out[lo - a : hi - a] = new[lo:hi] == ref[lo + offset : hi + offset]
        return out

    def differs(a: int, b: int) -> np.ndarray:
        return ~on_diagonal(a, b)

    def resumes(a: int, b: int) -> np.ndarray:
        """[b - a] bool: token k continues the diagonal or starts an anchor."""
        out = on_diagonal(a, b)
        hi = min(b, has_anchor.size)
        if a < hi:
            out[: hi - a] |= has_anchor[a:hi]
        return out

    while i < n:
        stop = _first_true(differs, i, n)  # the run along the current diagonal: [i, stop)
        if stop > i:
            source[i:stop] = np.arange(i + offset, stop + offset)
            expected[i:stop] = source[i:stop]
            i = stop
            continue
        j = table.nearest(i, i + offset) if i + anchor <= n else None
        if j is not None:
            source[i : i + anchor] = np.arange(j, j + anchor)
            expected[i : i + anchor] = source[i : i + anchor]
            offset = j - i
            i += anchor
            continue
        # token i is unmatched; so is every token up to the next that continues the diagonal or anchors
        stop = _first_true(resumes, i + 1, n)
        expected[i:stop] = np.arange(i + offset, stop + offset)
        i = stop
    return source, expected


def match_same_token(
    new_ids: Sequence[int] | np.ndarray,
    ref_ids: Sequence[int] | np.ndarray,
    source: np.ndarray,
    expected: np.ndarray,
) -> np.ndarray:
    """For unmatched tokens: the reference occurrence of the same id nearest the expected position
    (the lower one on a tie). Returns a bool mask [n] of the tokens matched here (``source`` is
    filled in place). One sort of the reference and one ``searchsorted`` for all tokens."""
    new, ref = as_ids(new_ids), as_ids(ref_ids)
    found = np.zeros(source.size, dtype=bool)
    todo = np.flatnonzero(source < 0)
    if todo.size == 0 or ref.size == 0:
        return found
    want = expected[todo]
    tokens = new[todo]
    span = int(max(ref.size, int(want.max()) + 1, 1)) + 1  # key = token * span + position: one sort order
    lowest = int(min(ref.min(), tokens.min()))
    ref_keys = np.sort((ref - lowest) * span + np.arange(ref.size))
    query = (tokens - lowest) * span + np.clip(want, 0, None)
    at = np.searchsorted(ref_keys, query, side="left")
    below = np.clip(at - 1, 0, ref_keys.size - 1)
    above = np.clip(at, 0, ref_keys.size - 1)
    same_below = (at > 0) & (ref_keys[below] // span == tokens - lowest)
    same_above = (at < ref_keys.size) & (ref_keys[above] // span == tokens - lowest)
    pos_below, pos_above = ref_keys[below] % span, ref_keys[above] % span
    take_above = same_above & (~same_below | (pos_above - want < want - pos_below))
    ok = same_below | same_above
    chosen = np.where(take_above, pos_above, pos_below)
    source[todo[ok]] = chosen[ok]
    found[todo[ok]] = True
    return found


def match_signatures(
    new_bits: Tensor, ref_bits: Tensor, source: np.ndarray, min_similarity: float
) -> np.ndarray:
    """For unmatched tokens: the reference token with the most equal signature bits, if the
    agreement reaches ``min_similarity``. new_bits [n, B], ref_bits [m, B] bool. Returns the
    bool mask [n] of the tokens matched here (``source`` filled in place)."""
    found = np.zeros(source.size, dtype=bool)
    todo = np.flatnonzero(source < 0)
    if todo.size == 0 or ref_bits.shape[0] == 0:
        return found
    agreement = bit_agreement(new_bits[torch.from_numpy(todo)], ref_bits)
    best, where = agreement.max(dim=1)
    ok = (best >= min_similarity).cpu().numpy()  # matching runs on the host
    source[todo[ok]] = where.cpu().numpy()[ok]
    found[todo[ok]] = True
    return found


def match_tokens(
    new_ids: Sequence[int] | np.ndarray,
    ref_ids: Sequence[int] | np.ndarray,
    new_bits: Tensor | None,
    ref_bits: Tensor | None,
    anchor: int = 4,
    min_token_similarity: float = 0.8,
) -> TokenMatch:
    """Match every new token to a reference token (aligned runs, same id, nearest signature)."""
    new_ids, ref_ids = as_ids(new_ids), as_ids(ref_ids)
    source, expected = align_runs(new_ids, ref_ids, anchor)
    kind = np.where(source >= 0, ALIGNED, UNMATCHED).astype(np.int8)
    kind[match_same_token(new_ids, ref_ids, source, expected)] = SAME_TOKEN
    if new_bits is not None and ref_bits is not None:
        kind[match_signatures(new_bits, ref_bits, source, min_token_similarity)] = SIGNATURE
    return TokenMatch(source, kind, exact_prefix_length(new_ids, ref_ids))


def near_breaks(source: Tensor, forced: Tensor, window: int, previous: int = -1) -> Tensor | None:
    """The rows [R] (offsets, ascending) at most ``window - 1`` rows after a break in the alignment: a
    ``forced`` row (bool [n]) or a row whose reference row ``source`` [n] (-1: none) does not follow the
    previous row's; ``previous`` is the reference row of the row before the first (the exact prefix's
    last, -1: none). None for ``window`` 0 (every row)."""
    if window <= 0:
        return None
    n = source.numel()
    offsets = torch.arange(n, device=source.device)
    follows = torch.zeros(n, dtype=torch.bool, device=source.device)
    follows[0] = previous >= 0 and int(source[0]) == previous + 1
    follows[1:] = (source[1:] == source[:-1] + 1) & (source[:-1] >= 0)
    breaks = forced.to(source.device) | ~follows
    last_break = torch.where(breaks, offsets, torch.full_like(offsets, -n - window)).cummax(0).values
    return (offsets - last_break < window).nonzero().squeeze(1)


# -- the path ------------------------------------------------------------------------------------------
@dataclass
class SharePlan(Plan):
    reference: KVEntry
    match: TokenMatch
    config: ShareConfig
    similarity: float
    lookup_s: float
    match_s: float


class SharePath:
    """The share path of one engine: it owns the reference index and the token hashers.

    index_folder: where the reference index persists (None: in memory only).
    index_config: the index's MinHash / banding settings.
    max_open_indexes: non-default namespaces whose index stays open (least recently used closed).
    """

    name = "share"

    def __init__(
        self,
        index_folder: Path | None = None,
        index_config: IndexConfig | None = None,
        max_open_indexes: int = 64,
    ) -> None:
        self.index_folder = index_folder
        self.index_config = index_config or IndexConfig()
        self.index = PromptIndex(self.index_config, index_folder)  # the default namespace's
        self.max_open_indexes = max_open_indexes
        self._indexes: OrderedDict[str, PromptIndex] = OrderedDict()
        self._hashers: OrderedDict[tuple, TokenHasher] = OrderedDict()

    # -- indexes ------------------------------------------------------------------------------------
    def index_for(self, namespace: Namespace, create: bool = False) -> PromptIndex | None:
        """The reference index of ``namespace``; None when it has none yet and ``create`` is False."""
        scope = namespace.scope
        if scope is None:
            return self.index
        index = self._indexes.get(scope)
        if index is not None:
            self._indexes.move_to_end(scope)
            return index
        folder = None
        if self.index_folder is not None:
            folder = Path(self.index_folder) / NAMESPACES_DIR / namespace.folder_name
        if not create and (folder is None or not folder.is_dir()):
            return None
        index = PromptIndex(self.index_config, folder)
        self._indexes[scope] = index
        while len(self._indexes) > self.max_open_indexes:
            _, evicted = self._indexes.popitem(last=False)
            evicted.close()
        return index

    @property
    def write_errors(self) -> int:
        """Index writes (journal, snapshot) that failed, over every open index."""
        return self.index.write_errors + sum(i.write_errors for i in self._indexes.values())

    # -- token signatures ---------------------------------------------------------------------------
    def token_hasher(self, ctx: PrefillContext, config: SimHashConfig) -> TokenHasher:
        """The hasher of ``config`` (embedding centre = the vocabulary mean), built once per config."""
        key = tuple(sorted(asdict(config).items()))
        hasher = self._hashers.get(key)
        if hasher is not None:
            self._hashers.move_to_end(key)
            return hasher
        adapter = ctx.runtime.adapter
        with torch.inference_mode():
            ids = torch.arange(adapter.vocab_size, device=ctx.runtime.device)
            center = adapter.embed(ids).float().mean(0)
        hasher = TokenHasher(config, adapter.hidden_size, center.cpu())
        self._hashers[key] = hasher
        while len(self._hashers) > MAX_HASHERS:
            self._hashers.popitem(last=False)
        return hasher

    def token_bits(self, ctx: PrefillContext, config: SimHashConfig, token_ids: list[int]) -> Tensor:
        """Signature bits bool [T, tables * bits] of ``token_ids`` at positions 0..T-1."""
        hasher = self.token_hasher(ctx, config)
        ids = torch.tensor(token_ids, dtype=torch.long, device=ctx.runtime.device)
        with torch.inference_mode():
            emb = ctx.runtime.adapter.embed(ids).float().cpu()
        return hasher.bits(emb, torch.arange(len(token_ids), device="cpu"))  # hashing runs on the host

    def reference_bits(self, ctx: PrefillContext, config: SimHashConfig, entry: KVEntry) -> Tensor:
        """The reference's signature bits: stored ones when hashed with ``config``, else re-hashed."""
        stored = entry.extras.get(LSH_EXTRA)
        if (
            stored is not None
            and entry.meta.get("simhash") == asdict(config)
            and stored.dtype == torch.int64
            and tuple(stored.shape) == (len(entry.token_ids), config.tables)
        ):
            return unpack_bits(stored, config.bits)
        return self.token_bits(ctx, config, entry.token_ids)

    # -- remembering prompts ------------------------------------------------------------------------
    def after_prefill(
        self,
        ctx: PrefillContext,
        options: ReuseOptions,
        layout: PromptLayout,
        cache: KVCache,
        outcome: PrefillOutcome,
    ) -> None:
        """Store an exactly prefilled prompt's KV + token signatures as a PROMPT entry and index it, unless
        less than ``min_new_fraction`` of it was computed (the rest loaded as an exact stored prefix)."""
        config = options.share
        token_ids = layout.token_ids
        if not outcome.exact or len(token_ids) < config.min_tokens:
            return
        if outcome.recomputed_tokens < config.min_new_fraction * len(token_ids):
            return
        key = prompt_key(ctx.fingerprint, token_ids, options.namespace)
        if not ctx.store.held_by_all(key):
            k, v = cache.export(0, len(token_ids))
            bits = self.token_bits(ctx, config.simhash, token_ids)
            entry = KVEntry(
                key,
                EntryKind.PROMPT,
                ctx.fingerprint,
                list(token_ids),
                k,
                v,
                extras={LSH_EXTRA: pack_bits(bits, config.simhash.bits)},
                meta={"simhash": asdict(config.simhash)},
            )
            ctx.store.put(entry)
        index = self.index_for(options.namespace, create=True)
        assert index is not None
        if key not in index:
            index.add(key, token_ids)

    # -- the path -----------------------------------------------------------------------------------
    def plan(self, ctx: PrefillContext, options: ReuseOptions, layout: PromptLayout) -> SharePlan | Refusal:
        config = options.share
        token_ids = layout.token_ids
        if len(token_ids) < config.min_tokens:
            return Refusal(self.name, f"prompt of {len(token_ids)} tokens < min_tokens {config.min_tokens}")
        index = self.index_for(options.namespace)
        if index is None or len(index) == 0:
            return Refusal(self.name, "no stored prompt to share from")
        start = time.perf_counter()
        hits = index.query(index.signature(token_ids), top=config.candidates)
        lookup_s = time.perf_counter() - start
        if not hits or hits[0].similarity < config.min_similarity:
            best = f"{hits[0].similarity:.3f}" if hits else "none shares a band"
            return Refusal(
                self.name,
                f"no similar stored prompt (best similarity {best} < min_similarity {config.min_similarity};"
                f" lookup {1000 * lookup_s:.2f} ms over {len(index)} prompts)",
            )
        reference, similarity = None, 0.0
        for hit in hits:
            if hit.similarity < config.min_similarity:
                break
            reference = ctx.store.get(hit.key, kind=EntryKind.PROMPT)
            if (
                reference is not None
                and prompt_key(ctx.fingerprint, reference.token_ids, options.namespace) != hit.key
            ):
                log.warning(
                    "share reference %s does not hold the prompt its key names; not used", hit.key[:12]
                )
                reference = None
            if reference is not None:
                similarity = hit.similarity
                break
            log.info("share reference %s left the store; dropping it from the index", hit.key[:12])
            index.remove(hit.key)
        if reference is None:
            return Refusal(self.name, "the similar stored prompts are no longer in the store")
        start = time.perf_counter()
        new_bits = self.token_bits(ctx, config.simhash, token_ids)
        ref_bits = self.reference_bits(ctx, config.simhash, reference)
        match = match_tokens(
            token_ids, reference.token_ids, new_bits, ref_bits, config.anchor, config.min_token_similarity
        )
        match_s = time.perf_counter() - start
        if match.aligned_rate < config.min_match_rate:
            return Refusal(
                self.name,
                f"reference {reference.key[:16]} (similarity {similarity:.3f}): aligned match rate "
                f"{match.aligned_rate:.3f} < min_match_rate {config.min_match_rate} "
                f"(any match {match.match_rate:.3f})",
            )
        # Offer what is reused without recompute: the exact prefix, plus the matched tokens after
        # it discounted by the expected recompute share, so an exact prefix hit that covers
        # more wins under reuse="auto".
        prefix = min(match.exact_prefix, len(token_ids) - 1)
        aligned_after = int((match.kind[prefix:] == ALIGNED).sum())
        if prefix < len(token_ids) - 1 and aligned_after < config.min_aligned_after_prefix:
            return Refusal(
                self.name,
                f"only {aligned_after} tokens after the exact prefix of {prefix} tokens match in aligned "
                f"runs (< min_aligned_after_prefix {config.min_aligned_after_prefix}; left to exact prefix reuse)",
            )
        rest = int((match.kind[prefix:-1] != UNMATCHED).sum())
        reused = prefix + int(rest * (1.0 - config.mean_recompute(ctx.runtime.num_layers)))
        return SharePlan(self.name, layout, reused, reference, match, config, similarity, lookup_s, match_s)

    def prefill(self, ctx: PrefillContext, plan: Plan, cache: KVCache) -> PrefillOutcome:
        assert isinstance(plan, SharePlan)
        config, match, ref = plan.config, plan.match, plan.reference
        token_ids = plan.layout.token_ids
        n = len(token_ids)
        prefix = min(match.exact_prefix, n - 1)
        device = ctx.runtime.device
        with ctx.store.pinned([ref.key]):
            if prefix:
                ctx.runtime.load_rows(
                    cache,
                    ref.k[:, :, :prefix],
                    ref.v[:, :, :prefix],
                    ctx.runtime.positions(0, prefix),
                    token_ids[:prefix],
                )
            rows = torch.arange(prefix, n, device="cpu")  # host offsets, matched on the host
            source = torch.from_numpy(match.source[prefix:])
            if config.unmatched == "drop":
                keep = source >= 0
                keep[-1] = True
                rows, source = rows[keep], source[keep]
            start = ctx.runtime.load_pieces(
                cache,
                [RowSource.gathered(ref.k, ref.v, source)],
                rows.to(device),
                [token_ids[int(i)] for i in rows],
            )
        forced = source < 0
        if config.scattered == "recompute":
            kinds = torch.from_numpy(match.kind[prefix:]).to(torch.long)[rows - prefix]
            forced |= kinds != ALIGNED
        forced[-config.recompute_last :] = True
        selector = deviation_recompute(
            forced.to(device), config.ratios(ctx.runtime.num_layers), config.deviation_on
        )
        layer0 = near_breaks(source, forced, config.layer0_window, prefix - 1)
        logits = ctx.runtime.forward_rows(
            cache, start, selector, rows=None if layer0 is None else layer0.to(device)
        )
        entered = rows.numel() if layer0 is None else layer0.numel()
        return self._outcome(logits, plan, selector, prefix, entered, rows.numel(), ctx.runtime.num_layers)

    def _outcome(
        self,
        logits: Tensor,
        plan: SharePlan,
        selector: SelectiveRecompute,
        prefix: int,
        entered: int,
        computed: int,
        num_layers: int,
    ) -> PrefillOutcome:
        """entered: rows layer 0 recomputed; computed: rows loaded after the exact prefix (not dropped)."""
        n = plan.match.num_tokens
        kept = [entered]
        for layer in range(1, num_layers):
            chosen = selector.chosen.get(layer)
            kept.append(int(chosen.numel()) if chosen is not None else kept[-1])
        recomputed = int(selector.recomputed_rows().numel())
        # Exact only if no reused row survived past layer 0 (e.g. an identical prompt: only the
        # last token is computed, on top of the exact prefix).
        exact = plan.config.unmatched == "recompute" and all(k == computed for k in kept)
        match = plan.match
        info = {
            "share_reference": plan.reference.key[:16],
            "share_similarity": plan.similarity,
            "share_match_rate": match.match_rate,
            "share_aligned_rate": match.aligned_rate,
            "share_matches": match.counts(),
            "share_exact_prefix": prefix,
            "share_forced": int(selector.forced.sum()),
            "share_layer0_rows": entered,
            "share_dropped": n - prefix - computed,
            "share_layer_rows": kept,
            "share_recompute_fraction": sum(kept) / (num_layers * n),
            "share_lookup_ms": 1000 * plan.lookup_s,
            "share_match_ms": 1000 * plan.match_s,
            "share_schedule": plan.config.schedule,
            "share_unmatched": plan.config.unmatched,
        }
        return PrefillOutcome(
            logits,
            self.name,
            reused_tokens=n - recomputed,
            recomputed_tokens=recomputed,
            exact=exact,
            info=info,
        )
