"""Probe's shortlist rescoring: the mean keys shortlist ``rescore x budget`` blocks, their exact attention picks.

Injected: bad ``rescore`` settings; a hand-built one-layer cache (block size 4, head dim 8) where the
query's mean-key ranking is wrong: two decoy blocks whose every key leans mildly towards the query (the
best mean logits), and a needle block whose keys lean away from it but for one key aligned with it
(a middling mean logit, an attention weight far above any decoy key's); a tiny 2-layer Llama (block size
4, 200-token prompt, 10% budget, the question probe on) decoding 8 steps with rescore 2, its gather hook
wrapped to capture each layer's query and keys as the layer attends, once with one selection per step
(previous step's queries), once with every layer its own selection (its current query), and once with one
selection per step rescored by every second layer only (``rescore_stride=2``).
Must happen: a bad setting raises a ValueError naming ``rescore`` (``rescore_stride``); on the hand-built
cache the plain probe keeps the decoys, the probe with rescore keeps the needle block, and both its choice and that of the
exact-keys probe equal the top of the exact attention computed here independently (over the shortlist's,
the sink's and the window's rows for rescore; over every row for exact keys); in the decode, every step's
selection is the question's reserved blocks plus the budget's rest taken, by the exact attention of the
same queries computed here independently (rows: shortlist, sink, window; the new row only for a current
query; with a stride, the group's layers 0, 2, ... only), from the ``ceil(rescore x budget)`` blocks the
mean keys rank best besides the reserved ones, and at some step that differs from the mean keys' own choice.
"""

from __future__ import annotations

import math

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.models.cache import KVCache
from semkv.sparse import SparseConfig, SparseDecoder
from semkv.sparse.base import StepView, topk_blocks
from semkv.sparse.index import BlockIndex, PrefillQueries, capture_prefill_queries
from semkv.sparse.probe import (
    ProbePolicy,
    ScratchBuffers,
    head_block_mass,
    mean_key_scores,
    shortlist_block_mass,
    window_block_scores,
)
from tests.conftest import tiny_hf_model
from tests.sparse.test_probe_exact_layers import Capture  # per (step, layer): query and keys

BLOCK = 4


@pytest.mark.parametrize("value", [-1.0, 0.5, 0.999, float("nan"), float("inf"), True, "3", None])
def test_bad_rescore(value):
    with pytest.raises(ValueError, match="rescore must be 0 \\(off\\) or a finite number >= 1"):
        ProbePolicy(rescore=value)


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2", None])
def test_bad_rescore_stride(value):
    with pytest.raises(ValueError, match="rescore_stride must be an integer >= 1"):
        ProbePolicy(rescore=3, rescore_stride=value)


def test_good_rescore_values_are_kept():
    assert ProbePolicy(rescore=0).rescore == 0
    assert ProbePolicy(rescore=3).describe()["rescore"] == 3


def exact_block_mass(
    q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor
) -> torch.Tensor:
    """[S] per block of ``blocks``, the largest share of one query head's attention over the rows ``rows``
    (q [nh, d], keys [kvh, T, d]): written out here, not the policy's code."""
    group = q.shape[0] // keys.shape[0]
    seen = keys[:, rows].repeat_interleave(group, dim=0)  # [nh, R, d]
    probs = torch.softmax(torch.einsum("hd,hrd->hr", q, seen) / math.sqrt(q.shape[-1]), dim=-1)
    index = {int(r): i for i, r in enumerate(rows)}
    out = []
    for block in blocks.tolist():
        cols = [index[block * BLOCK + i] for i in range(BLOCK)]
        out.append(float(probs[:, cols].sum(-1).amax()))
    return torch.tensor(out)


# -- a cache where the mean keys rank wrong --------------------------------------------------------------
NUM_BLOCKS = 12
DIM = 8
DECOYS = (3, 8)  # every key leans towards the query: the best mean logits
NEEDLE = 6  # keys lean away but for one aligned key: a middling mean logit, the largest attention


def needle_cache() -> tuple[KVCache, torch.Tensor]:
    """A one-layer cache of 12 blocks + 2 rows (the window; the last row is the step's new one) and the
    query [1, d] (one head, one KV head)."""
    rows = NUM_BLOCKS * BLOCK + 2
    generator = torch.Generator().manual_seed(0)
    keys = 0.1 * torch.randn(1, rows, DIM, generator=generator)
    keys[0, :, 0] = -0.5  # background: leans away from the query
    for block, lean in zip(DECOYS, (1.0, 0.9), strict=True):
        keys[0, block * BLOCK : (block + 1) * BLOCK, 0] = lean
    keys[0, NEEDLE * BLOCK : (NEEDLE + 1) * BLOCK, 0] = -0.6
    keys[0, NEEDLE * BLOCK + 2, 0] = 3.0  # mean 0.3: below the decoys', above the background's
    cache = KVCache(1, 1, DIM, rows, torch.float32, torch.float32)
    cache.append_rows(torch.arange(rows), list(range(rows)))
    cache.write(0, slice(0, rows), keys, keys, keys)
    query = torch.zeros(1, DIM)
    query[0, 0] = 4.0
    return cache, query


def select_on(cache: KVCache, query: torch.Tensor, policy: ProbePolicy, budget: int) -> torch.Tensor:
    """The blocks ``policy`` keeps at a step of ``cache`` (sink block 0; candidates 1..11; the prompt's
    last query is ``query``, at the step's start or, for an exact layer, as layer 0's current query)."""
    index = BlockIndex(cache, BLOCK)
    index.add_blocks()
    prefill = PrefillQueries({0: query.unsqueeze(1)}, {0: torch.tensor([cache.length - 2])}, window=1)
    candidates = torch.arange(1, NUM_BLOCKS)
    view = StepView(cache, index, candidates, budget, 0, prefill=prefill, selecting=(0,))
    policy.prepare(view)
    if policy.exact_layers:
        view = StepView(cache, index, candidates, budget, 0, 0, query.unsqueeze(1), prefill, (0,), (0,))
    return topk_blocks(policy.score(view), candidates, budget)


def test_rescore_keeps_the_block_with_one_aligned_key():
    cache, query = needle_cache()
    budget = 2
    plain = select_on(cache, query, ProbePolicy(prompt_share=0.0), budget)
    assert sorted(plain.tolist()) == sorted(DECOYS)  # the mean keys rank the needle block below the decoys

    rescored = select_on(cache, query, ProbePolicy(prompt_share=0.0, rescore=2.0), budget)
    index = BlockIndex(cache, BLOCK)
    index.add_blocks()
    means = index.summary("rmean")[:, :, 1:NUM_BLOCKS]
    cheap = mean_key_scores(query.unsqueeze(0), means, "max")[0]
    shortlist = torch.topk(cheap, 2 * budget).indices + 1
    assert NEEDLE in shortlist.tolist()  # third by the mean keys: on a shortlist of 2 x budget
    read = torch.cat([torch.arange(BLOCK), *(torch.arange(BLOCK) + b * BLOCK for b in shortlist.tolist())])
    read = torch.cat([read, torch.arange(NUM_BLOCKS * BLOCK, cache.length - 1)])  # window, not the new row
    exact = exact_block_mass(query, cache.keys(0), read, shortlist)
    expected = shortlist[torch.topk(exact, budget).indices].sort().values
    assert rescored.tolist() == expected.tolist()
    assert NEEDLE in rescored.tolist()

    # the exact-keys probe (every key read) makes the same choice here
    exact_probe = ProbePolicy(prompt_share=0.0, exact_layers=(0,), exact_keys=True)
    every = exact_block_mass(query, cache.keys(0), torch.arange(cache.length), torch.arange(1, NUM_BLOCKS))
    assert select_on(cache, query, exact_probe, budget).tolist() == rescored.tolist()
    assert rescored.tolist() == (torch.topk(every, budget).indices + 1).sort().values.tolist()


# -- a decode on a tiny model ----------------------------------------------------------------------------
STEPS = 8
CONFIG = dict(kv_budget=0.1, sink_blocks=1, window_tokens=8, reselect_every=1)  # a choice every step
RESCORE = 2.0


@pytest.mark.parametrize(
    "per_layer, stride",
    [(False, 1), (True, 1), (False, 2)],
    ids=["once-per-step", "every-layer-current-query", "once-per-step-every-2nd-layer-rescores"],
)
def test_decode_selection_is_the_exact_top_of_the_shortlist(tokenizer, per_layer, stride):
    model = tiny_hf_model("llama", len(tokenizer))
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    ids = torch.randint(3, len(tokenizer), (200,), generator=torch.Generator().manual_seed(7)).tolist()
    cache = runtime.new_cache(len(ids) + STEPS + 1)
    with capture_prefill_queries(cache) as queries:
        logits = runtime.prefill(cache, ids)
    layers = runtime.num_layers
    policy = ProbePolicy(
        rescore=RESCORE, rescore_stride=stride, exact_layers=tuple(range(layers)) if per_layer else ()
    )
    decoder = SparseDecoder(policy, SparseConfig(**CONFIG), BLOCK, prefill=queries)
    capture = Capture(decoder)
    for _ in range(STEPS):
        logits = runtime.decode(cache, int(logits.argmax()), capture)
    decoder.finish()

    groups = [(layer,) for layer in range(layers)] if per_layer else [tuple(range(layers))]
    means = decoder.index.summary("rmean")  # complete blocks' summaries never change
    prompt_blocks = len(ids) // BLOCK
    question = torch.stack(
        [
            window_block_scores(
                queries.q[layer][:, -policy.window :],
                capture.seen[(0, layer)][1][:, : len(ids)],
                BLOCK,
                prompt_blocks,
                "max",
            )
            for layer in range(layers)
        ]
    )  # [L, prompt blocks]
    differs = 0
    for step, record in enumerate(decoder.records):
        assert len(record.selected) == len(groups)
        length = record.context_tokens
        win_block = (length - CONFIG["window_tokens"]) // BLOCK
        budget = len(record.selected[0])
        for g, group in enumerate(groups):
            current = group[0] if per_layer else None

            def query(layer: int, step: int = step, current: int | None = current) -> torch.Tensor:
                if layer == current:
                    return capture.seen[(step, layer)][0]
                return queries.q[layer][:, -1] if step == 0 else capture.seen[(step - 1, layer)][0]

            # the question's reserved share, then the mean keys' order of the rest
            asked = question[list(group)].mean(dim=0)
            asked = torch.cat([asked, torch.zeros(max(0, win_block - prompt_blocks))])[1:win_block]
            reserved = set((torch.topk(asked, round(0.5 * budget)).indices + 1).tolist())
            q = torch.stack([query(layer) for layer in group])
            cheap = mean_key_scores(q, means[list(group)][:, :, 1:win_block], "max").mean(dim=0)
            order = [int(b) + 1 for b in torch.argsort(cheap, descending=True, stable=True)]
            rest = [b for b in order if b not in reserved]
            shortlist = sorted(reserved) + rest[: math.ceil(RESCORE * budget)]
            # the exact attention of the same queries over the rows read
            blocks = torch.tensor(shortlist)
            exact = []
            for layer in group[::stride]:
                keys = capture.seen[(step, layer)][1]
                end = length if layer == current else length - 1  # the new row: for the current query only
                read = torch.cat(
                    [torch.arange(BLOCK), (blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten()]
                )
                read = torch.cat([read, torch.arange(win_block * BLOCK, end)])
                exact.append(exact_block_mass(query(layer), keys, read, blocks))
            exact = torch.stack(exact).mean(dim=0)
            ranked = [
                shortlist[i]
                for i in torch.argsort(exact, descending=True).tolist()
                if shortlist[i] not in reserved
            ]
            expected = sorted(reserved | set(ranked[: budget - len(reserved)]))
            assert record.selected[g] == expected, (step, group)
            cheap_choice = sorted(reserved | set(rest[: budget - len(reserved)]))
            differs += cheap_choice != expected
    assert differs > 0  # the exact check changed the mean keys' choice at some step


# -- the fused gather-and-score kernel -------------------------------------------------------------------
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_shortlist_block_mass_equals_the_mass_over_gathered_keys(compute_dtype):
    """Injected: a 3-layer cache (2 KV heads, 6 query heads, head dim 8, block size 4) in float32 or bfloat16,
    scored three times with one set of buffers, on shortlists of 5, 2 and 7 blocks (the buffers shrink in
    use, then grow). Must happen: each result equals ``head_block_mass`` over the same rows gathered afresh
    into float32 (the new row masked for every layer but the flagged one), so no buffer carries a stale
    row from an earlier, longer call."""
    cache = KVCache(3, 2, 8, 64, torch.float32, compute_dtype)
    cache.reserve(64)
    g = torch.Generator().manual_seed(3)
    assert cache.append_rows(torch.arange(60), list(range(60))) == 0
    for layer in range(3):
        k = torch.randn(2, 60, 8, generator=g)
        cache.write(layer, slice(0, 60), k, k, torch.randn(2, 60, 8, generator=g))
    q = torch.randn(3, 6, 8, generator=g)
    buffers = ScratchBuffers()
    for count in (5, 2, 7):
        blocks = torch.randperm(12, generator=g)[:count]
        read = torch.cat(
            [(blocks.unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten(), torch.arange(56, 60)]
        )
        attends_new = torch.tensor([False, True, False])
        got = shortlist_block_mass(q, cache, (0, 1, 2), read, attends_new, BLOCK, count, buffers)
        keys = torch.stack([cache.keys(layer).index_select(1, read).float() for layer in range(3)])
        visible = torch.ones(3, read.numel(), dtype=torch.bool)
        visible[:, -1] = attends_new
        want = head_block_mass(q.unsqueeze(2), keys, BLOCK, count, visible[:, None, None, None])[:, :, 0]
        assert got.shape == (3, 6, count)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
