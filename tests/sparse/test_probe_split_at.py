"""Probe layer groups cut at ``split_at``: a new probe selects for the layers from the split up.

Injected: bad ``split_at`` settings; selecting-layer lists cut at one or more layers, with ``groups`` and
``exact_layers`` on top and with a split at a layer that does not select; a tiny 6-layer Llama (block size
4, 200-token prompt, 10% budget, question probe off) decoding 8 steps with ``split_at=(3,)``, its gather
hook wrapped to capture each layer's query as the layer attends; a split at a layer the model lacks.
Must happen: a bad setting raises a ValueError naming the field; the groups are the selecting layers cut
at the splits (each part then split as ``groups`` and ``exact_layers`` say); each step makes one selection
per group; the upper group's is the budget's top blocks by layer 3's current query and layers 4-5's
previous ones (the lower group's by layer 0's current and 1-2's previous), and the two groups choose
differently at some step (one shared choice would not serve both); a split beyond the model is refused.
"""

from __future__ import annotations

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
CONFIG = dict(kv_budget=0.1, sink_blocks=1, window_tokens=8, reselect_every=1)


@pytest.mark.parametrize("value", [(0,), (-1,), (3, 3), (1.5,), (True,), "3", 3])
def test_bad_split_at(value):
    with pytest.raises(ValueError, match="split_at must be distinct layer indices >= 1"):
        ProbePolicy(split_at=value)


@pytest.mark.parametrize(
    "options, selecting, groups",
    [
        ({"split_at": (3,)}, tuple(range(6)), ((0, 1, 2), (3, 4, 5))),
        ({"split_at": [4, 2]}, tuple(range(6)), ((0, 1), (2, 3), (4, 5))),  # any order, a list too
        ({"split_at": (11,)}, tuple(range(30)), (tuple(range(11)), tuple(range(11, 30)))),
        ({"split_at": (3,), "groups": 2}, tuple(range(6)), ((0, 1), (2,), (3, 4), (5,))),
        ({"split_at": (3,), "exact_layers": (4,)}, tuple(range(6)), ((0, 1, 2), (3,), (4,), (5,))),
        ({"split_at": (6, 12)}, (5, 11, 17), ((5,), (11,), (17,))),  # Gemma 3's global layers
        ({"split_at": (4,)}, (0, 2, 3, 5), ((0, 2, 3), (5,))),  # layer 4 does not select
        ({"split_at": (9,)}, (0, 2, 3, 5), ((0, 2, 3, 5),)),  # nothing above the split
    ],
)
def test_layer_groups(options, selecting, groups):
    assert ProbePolicy(**options).layer_groups(selecting) == groups


def test_each_group_chooses_with_its_own_probe(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer), num_hidden_layers=LAYERS)
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    ids = torch.randint(3, len(tokenizer), (200,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = runtime.new_cache(len(ids) + STEPS + 1)
    with capture_prefill_queries(cache) as queries:
        logits = runtime.prefill(cache, ids)
    decoder = SparseDecoder(
        ProbePolicy(prompt_share=0.0, split_at=(3,)), SparseConfig(**CONFIG), BLOCK, prefill=queries
    )
    seen: dict[tuple[int, int], torch.Tensor] = {}

    class Capture:
        """The decoder's gather hook, keeping each (step, layer)'s query [nh, d]."""

        def gather(self, layer, q_rot, c):
            picked = decoder.gather(layer, q_rot, c)
            seen[(len(decoder.records) - 1, layer)] = q_rot[:, 0].float().clone()
            return picked

    for _ in range(STEPS):
        logits = runtime.decode(cache, int(logits.argmax()), Capture())
    decoder.finish()
    last = {layer: queries.q[layer][:, -1].float() for layer in range(LAYERS)}
    means = decoder.index.summary("rmean")
    differ = 0
    for step, record in enumerate(decoder.records):
        assert len(record.selected) == 2  # one selection per group and step
        sink, win_block = 1, (record.context_tokens - CONFIG["window_tokens"]) // BLOCK
        candidates = torch.arange(sink, win_block)
        budget = len(record.selected[0])
        for g, layers in enumerate(((0, 1, 2), (3, 4, 5))):
            q = torch.stack(
                [seen[(step, layers[0])]]
                + [last[layer] if step == 0 else seen[(step - 1, layer)] for layer in layers[1:]]
            )
            scores = mean_key_scores(q, means[layers[0] : layers[-1] + 1, :, sink:win_block], "max").mean(0)
            assert record.selected[g] == topk_blocks(scores, candidates, budget).tolist(), (step, g)
        differ += record.selected[0] != record.selected[1]
    assert differ > 0


def test_split_beyond_the_model_is_refused(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    cache = runtime.new_cache(80)
    with capture_prefill_queries(cache) as queries:
        runtime.prefill(cache, list(range(5, 70)))
    decoder = SparseDecoder(
        ProbePolicy(split_at=(1, 2)),
        SparseConfig(kv_budget=0.2, window_tokens=6, reselect_every=1),
        4,
        prefill=queries,
    )
    with pytest.raises(ValueError, match=r"split_at \[2\] are not layers of a 2-layer model"):
        runtime.decode(cache, 5, decoder)
