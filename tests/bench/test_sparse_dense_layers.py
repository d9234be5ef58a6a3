"""Dense layers chosen from the bench's run labels ("probe+dense0,1") reach the sparse decoder.

Injected: run labels with and without "+dense<layers>" (well-formed and malformed), decoded on a tiny
4-layer engine; a dense layer the model does not have; RULER case records of one case split by policy.
Must happen: a bad label is refused with a ValueError naming dense_layers before any model loads; the
named layers attend to every row (no selection recorded for them; with every layer dense a 10% budget
gives dense's logits, without it the logits differ); a layer beyond the model is refused; split records
of a case merge their runs.
"""

from __future__ import annotations

import json

import pytest
import torch

from semkv.bench.sparse import make_decoder, split_dense_layers, validate_labels
from semkv.bench.sparse_ruler import load_records
from semkv.request import GenerateRequest
from tests.conftest import tiny_hf_model

PROMPT = " ".join(f"word{i} is number {i * 7 % 13}." for i in range(40))
LAYERS = 4


@pytest.mark.parametrize(
    "label, parsed",
    [
        ("probe", ("probe", ())),
        ("probe+dense0,1", ("probe", (0, 1))),
        ("oracle+dense3,0", ("oracle", (0, 3))),
        ("probe:head_agg='mass'+dense29", ("probe:head_agg='mass'", (29,))),
    ],
)
def test_split_dense_layers(label, parsed):
    assert split_dense_layers(label) == parsed


@pytest.mark.parametrize(
    "label",
    ["probe+dense", "probe+densex", "probe+dense-1", "probe+dense0,0", "probe+dense1.5", "probe+dense0,"],
)
def test_bad_dense_layers_label(label):
    with pytest.raises(ValueError, match="dense_layers"):
        validate_labels([label])


def test_validate_labels_checks_the_policy_too():
    validate_labels(["probe+dense0,1", "keykey-plain+dense0", "probe:head_agg='mass'"])
    with pytest.raises(ValueError, match="unknown sparse policy"):
        validate_labels(["probb+dense0"])


@pytest.fixture
def engine_and_prefill(make_tiny_engine, tokenizer):
    engine = make_tiny_engine(
        "llama", block_size=4, hf_model=tiny_hf_model("llama", len(tokenizer), num_hidden_layers=LAYERS)
    )
    request = GenerateRequest(
        prompt=PROMPT, max_new_tokens=8, stop_at_eos=False, reuse="none", store_prompt=False
    )
    return engine, engine.prefill(request, capture_queries=True)


def _logits(engine, base, decoder, feed: list[int]) -> list[torch.Tensor]:
    """Per step logits [V], teacher-forced with ``feed`` (so every run sees the same tokens)."""
    seq = engine.fork(base, sparse=decoder)
    return [engine.decode_step(seq, feed=token).clone() for token in feed]


def test_dense_layers_reach_the_decoder(engine_and_prefill):
    """Oracle selects per layer: with layers 0 and 2 dense, each step records a choice for layers 1 and 3
    only; the decoder's config carries the layers."""
    engine, base = engine_and_prefill
    decoder = make_decoder(engine, "oracle+dense0,2", 0.1, {})
    assert decoder.config.dense_layers == (0, 2)
    seq = engine.fork(base, sparse=decoder)
    for _ in range(4):
        engine.decode_step(seq)
    decoder.finish()
    assert len(decoder.records) == 4
    assert all(len(record.selected) == LAYERS - 2 for record in decoder.records)


@pytest.mark.parametrize("policy", ["keykey", "probe", "oracle"])
def test_every_layer_dense_is_dense(engine_and_prefill, policy):
    """A 10% budget changes the logits; the same budget with every layer dense gives dense's logits."""
    engine, base = engine_and_prefill
    feed = [base.tokens[-1], 11, 12, 13, 14]
    dense = _logits(engine, base, None, feed)
    sparse = _logits(engine, base, make_decoder(engine, policy, 0.1, {}), feed)
    all_dense = _logits(engine, base, make_decoder(engine, f"{policy}+dense0,1,2,3", 0.1, {}), feed)
    assert not all(torch.allclose(s, d, atol=1e-5) for s, d in zip(sparse, dense, strict=True))
    for got, want in zip(all_dense, dense, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dense_layer_beyond_the_model_is_refused(engine_and_prefill):
    engine, base = engine_and_prefill
    with pytest.raises(ValueError, match=r"dense_layers \[7\]"):
        engine.fork(base, sparse=make_decoder(engine, "probe+dense0,7", 0.1, {}))


def test_records_of_one_case_merge_their_runs(tmp_path):
    """Runs of a case split over two result files (e.g. policies in two processes) join; a run in both
    files takes the later record."""
    case = {"length": 4096, "task": "vt", "index": 0, "prompt_tokens": 4000}
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps({**case, "runs": {"dense": {"score": 50}, "probe@0.1": {"score": 0}}}) + "\n")
    second.write_text(
        json.dumps({**case, "runs": {"dense": {"score": 50}, "probe+dense0,1@0.1": {"score": 100}}})
        + "\n"
        + json.dumps({**case, "index": 1, "runs": {"dense": {"score": 0}}})
        + "\n"
    )
    records = sorted(load_records([first, second]), key=lambda r: r["index"])
    assert [r["index"] for r in records] == [0, 1]
    assert records[0]["runs"] == {
        "dense": {"score": 50},
        "probe@0.1": {"score": 0},
        "probe+dense0,1@0.1": {"score": 100},
    }
