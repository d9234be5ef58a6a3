"""Probe's exact layers: chosen layers select alone, with their own current query, before they attend.

Injected: bad ``exact_layers`` / ``exact_keys`` settings; selecting-layer lists with exact layers at the
start, middle and end, with ``groups`` > 1, and with exact layers that do not select; a tiny 6-layer Llama
(block size 4, 200-token prompt, 10% budget, question probe off) decoding 8 steps with exact layers 2 and
3, its gather hook wrapped to capture each layer's query and keys as the layer attends.
Must happen: a bad setting raises a ValueError naming the field; the layer groups are exactly the runs of
selecting layers between the exact layers, each exact layer alone; each decode step makes one selection
per group, an exact layer's selection is the budget's top blocks by its own current query (the blocks'
mean keys; with ``exact_keys`` the true attention over every key, an independent computation here), and
differs at some step from what the previous step's query would have chosen; the shared group (0, 1)
chooses by layer 0's current and layer 1's previous query; the residency hint keeps every group's
choices of the last ``keep_steps`` steps; a layer the model does not have is refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.sparse import SparseConfig, SparseDecoder
from semkv.sparse.base import topk_blocks
from semkv.sparse.index import capture_prefill_queries
from semkv.sparse.probe import ProbePolicy, mean_key_scores
from tests.conftest import tiny_hf_model

BLOCK = 4
LAYERS = 6
STEPS = 8
CONFIG = dict(kv_budget=0.1, sink_blocks=1, window_tokens=8, reselect_every=1)  # a choice every step
EXACT = (2, 3)
GROUPS = ((0, 1), (2,), (3,), (4, 5))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"exact_layers": (-1,)},
        {"exact_layers": (3, 3)},
        {"exact_layers": (1.5,)},
        {"exact_layers": (True,)},
        {"exact_layers": "3"},
        {"exact_layers": 3},
    ],
)
def test_bad_exact_layers(kwargs):
    with pytest.raises(ValueError, match="exact_layers must be distinct layer indices >= 0"):
        ProbePolicy(**kwargs)


def test_exact_keys_needs_exact_layers():
    with pytest.raises(ValueError, match="exact_keys needs exact_layers"):
        ProbePolicy(exact_keys=True)


@pytest.mark.parametrize(
    "options, selecting, groups",
    [
        ({}, (0, 1, 2, 3, 4, 5), ((0, 1, 2, 3, 4, 5),)),
        ({"exact_layers": (2, 3)}, (0, 1, 2, 3, 4, 5), GROUPS),
        ({"exact_layers": [3, 2]}, (0, 1, 2, 3, 4, 5), GROUPS),  # any order, a list too
        ({"exact_layers": (0, 5)}, (0, 1, 2, 3, 4, 5), ((0,), (1, 2, 3, 4), (5,))),
        ({"exact_layers": (2,), "groups": 2}, (0, 1, 2, 3, 4, 5), ((0, 1), (2,), (3, 4, 5))),
        ({"exact_layers": (4,), "groups": 2}, (0, 1, 2, 3, 4, 5), ((0, 1, 2), (3,), (4,), (5,))),
        ({"exact_layers": (1, 7)}, (0, 2, 3, 5), ((0, 2, 3, 5),)),  # 1 and 7 do not select
        (
            {"exact_layers": tuple(range(3, 11))},
            tuple(range(30)),
            ((0, 1, 2), *((i,) for i in range(3, 11)), tuple(range(11, 30))),
        ),
    ],
)
def test_layer_groups(options, selecting, groups):
    assert ProbePolicy(**options).layer_groups(selecting) == groups


class Capture:
    """Wraps a decoder's gather hook: per (step, layer) the query [nh, d] and the keys [kvh, T, d]."""

    def __init__(self, decoder: SparseDecoder) -> None:
        self.decoder = decoder
        self.seen: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def gather(self, layer: int, q_rot: torch.Tensor, cache):
        picked = self.decoder.gather(layer, q_rot, cache)
        step = len(self.decoder.records) - 1
        self.seen[(step, layer)] = (q_rot[:, 0].float().clone(), cache.keys(layer).float().clone())
        return picked


def decode(tokenizer, **options) -> tuple[Capture, torch.Tensor]:
    """8 greedy steps with the probe (question probe off); returns the capture and the last prompt
    queries [L, nh, d]."""
    model = tiny_hf_model("llama", len(tokenizer), num_hidden_layers=LAYERS)
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    ids = torch.randint(3, len(tokenizer), (200,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = runtime.new_cache(len(ids) + STEPS + 1)
    with capture_prefill_queries(cache) as queries:
        logits = runtime.prefill(cache, ids)
    policy = ProbePolicy(prompt_share=0.0, exact_layers=EXACT, **options)
    decoder = SparseDecoder(policy, SparseConfig(**CONFIG), BLOCK, prefill=queries)
    capture = Capture(decoder)
    for _ in range(STEPS):
        logits = runtime.decode(cache, int(logits.argmax()), capture)
    decoder.finish()
    last = torch.stack([queries.q[layer][:, -1] for layer in range(LAYERS)])
    return capture, last


def previous_query(capture: Capture, last: torch.Tensor, step: int, layer: int) -> torch.Tensor:
    """[nh, d] the query ``layer`` had at the step before ``step`` (the prompt's last at step 0)."""
    return last[layer] if step == 0 else capture.seen[(step - 1, layer)][0]


def true_block_mass(q: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """[C] per candidate block, the largest share of one head's attention (q [nh, d], keys [kvh, T, d])."""
    group = q.shape[0] // keys.shape[0]
    logits = torch.einsum("hd,htd->ht", q, keys.repeat_interleave(group, dim=0)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(logits, dim=-1)
    rows = candidates.unsqueeze(1) * BLOCK + torch.arange(BLOCK)
    return probs[:, rows].sum(-1).amax(dim=0)


@pytest.mark.parametrize("exact_keys", [False, True])
def test_exact_layers_choose_with_their_own_current_query(tokenizer, exact_keys):
    capture, last = decode(tokenizer, exact_keys=exact_keys)
    decoder = capture.decoder
    assert decoder.tier.layer_groups == [list(g) for g in GROUPS]
    means = decoder.index.summary("rmean")  # [L, kvh, nb, d]: complete blocks' summaries never change
    differs = 0
    for step, record in enumerate(decoder.records):
        assert len(record.selected) == len(GROUPS)  # one selection per group and step
        sink, win_block = 1, (record.context_tokens - CONFIG["window_tokens"]) // BLOCK
        candidates = torch.arange(sink, win_block)
        budget = len(record.selected[0])
        for g, layer in ((1, 2), (2, 3)):
            q, keys = capture.seen[(step, layer)]
            before = previous_query(capture, last, step, layer)
            if exact_keys:
                mine, old = (true_block_mass(x, keys, candidates) for x in (q, before))
            else:
                pages = means[layer : layer + 1, :, sink:win_block]
                mine, old = (mean_key_scores(x[None], pages, "max")[0] for x in (q, before))
            assert record.selected[g] == topk_blocks(mine, candidates, budget).tolist(), (step, layer)
            differs += not torch.equal(
                topk_blocks(old, candidates, budget), topk_blocks(mine, candidates, budget)
            )
        shared = torch.stack([capture.seen[(step, 0)][0], previous_query(capture, last, step, 1)])
        scores = mean_key_scores(shared, means[0:2, :, sink:win_block], "max").mean(dim=0)
        assert record.selected[0] == topk_blocks(scores, candidates, budget).tolist(), step
    assert differs > 0  # the current query matters: the previous one would have chosen otherwise
    # residency: every group's choices of the last keep_steps steps are worth keeping
    keep = decoder.policy.keep_steps
    recent = {b for record in decoder.records[-keep:] for selected in record.selected for b in selected}
    hint = decoder.policy.resident_hint()
    assert hint is not None and recent == set((hint >= 0).nonzero().flatten().tolist())


def test_exact_layer_beyond_the_model_is_refused(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    cache = runtime.new_cache(80)
    with capture_prefill_queries(cache) as queries:
        runtime.prefill(cache, list(range(5, 70)))
    policy = ProbePolicy(exact_layers=(1, 2))
    decoder = SparseDecoder(
        policy, SparseConfig(kv_budget=0.2, window_tokens=6, reselect_every=1), 4, prefill=queries
    )
    with pytest.raises(ValueError, match=r"exact_layers \[2\] are not layers of a 2-layer model"):
        runtime.decode(cache, 5, decoder)
