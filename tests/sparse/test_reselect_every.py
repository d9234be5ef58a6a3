"""Choosing blocks every k decode steps (``SparseConfig.reselect_every``) instead of every step.

Injected: a tiny Llama (2 layers, KV float32), block size 4, a 200-token prompt, kv_budget 0.1, one sink
block, an 8-token window (it moves one block forward every 4 steps), 12 teacher-forced decode
steps, and the policy's ``score`` wrapped to count its calls; keykey (one choice per step, at its
start) and the probe with an exact layer (one choice per layer group, at the group's first layer).
Must happen:

* with ``reselect_every=3`` the policy scores (once per group) exactly on the steps where the last
  choice is 3 steps old or was made from other candidates or another budget (the window moved off a
  block, the budget grew by one): some steps reuse, and some choose early because of the window;
* on the steps that reuse, each group attends to the blocks it chose last and nothing is copied into
  the fast tier (the chosen blocks are resident);
* with ``reselect_every=1`` it scores on every step; with a period longer than the generation only when
  the candidates or the budget change; the default is 4;
* bad periods (0, a bool, a float) and bad bench labels ("+every0", "+everyx") raise ValueError naming
  the field.
"""

from __future__ import annotations

import pytest
import torch

from semkv.bench.sparse import make_decoder, split_reselect_period, validate_labels
from semkv.models import Runtime, adapter_for
from semkv.sparse import Budget, SparseConfig, SparseDecoder, make_policy
from semkv.sparse.index import capture_prefill_queries
from tests.conftest import tiny_hf_model

BLOCK = 4
STEPS = 12
CONFIG = dict(kv_budget=0.1, sink_blocks=1, window_tokens=8)
FED = [5, 17, 23, 42, 8, 99, 64, 3, 11, 57, 21, 30]
POLICIES = [("keykey", {}), ("probe", {"exact_layers": (1,)})]


@pytest.fixture(scope="module")
def model_and_prompt(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    ids = torch.randint(3, len(tokenizer), (200,), generator=torch.Generator().manual_seed(5))
    return model, ids.tolist()


def decode(model, ids: list[int], policy: str, options: dict, every: int) -> tuple[SparseDecoder, list[int]]:
    """Decode STEPS teacher-forced tokens; returns the decoder and, per step, how often ``score`` ran."""
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    cache = runtime.new_cache(len(ids) + STEPS + 1)
    with capture_prefill_queries(cache) as queries:
        runtime.prefill(cache, ids)
    chosen = make_policy(policy, **options)
    decoder = SparseDecoder(chosen, SparseConfig(**CONFIG, reselect_every=every), BLOCK, prefill=queries)
    scored: list[int] = []
    score = chosen.score

    def counting(view):
        scored.append(len(decoder.records) - 1)
        return score(view)

    chosen.score = counting  # type: ignore[method-assign]
    for token in FED[:STEPS]:
        runtime.decode(cache, token, decoder)
    decoder.finish()
    return decoder, [scored.count(step) for step in range(STEPS)]


def choice_steps(decoder: SparseDecoder, every: int) -> list[int]:
    """The steps that must choose anew under ``reselect_every=every``, from each step's context length."""
    steps: list[int] = []
    last: tuple[int, tuple[int, int]] | None = None
    for record in decoder.records:
        window_block = (record.context_tokens - CONFIG["window_tokens"]) // BLOCK
        made_from = (window_block, Budget(CONFIG["kv_budget"]).blocks(record.context_tokens, BLOCK))
        if last is None or record.step - last[0] >= every or last[1] != made_from:
            steps.append(record.step)
            last = (record.step, made_from)
    return steps


@pytest.mark.parametrize("policy, options", POLICIES, ids=[p for p, _ in POLICIES])
def test_choice_is_reused_within_the_period_while_candidates_stay(policy, options, model_and_prompt):
    model, ids = model_and_prompt
    decoder, scored = decode(model, ids, policy, options, every=3)
    groups = len(decoder.tier.layer_groups)
    chosen = choice_steps(decoder, 3)
    assert scored == [groups if step in chosen else 0 for step in range(STEPS)]
    assert len(chosen) < STEPS  # some steps reuse
    assert any(b - a < 3 for a, b in zip(chosen[:-1], chosen[1:], strict=True))  # early: the window moved
    last: list[list[int]] = []
    for record in decoder.records:
        window_block = (record.context_tokens - CONFIG["window_tokens"]) // BLOCK
        assert all(1 <= b < window_block for blocks in record.selected for b in blocks)
        if record.step in chosen:
            last = record.selected
            assert record.select_s > 0
            continue
        assert record.selected == last
        assert record.loaded_blocks == 0 and record.select_s == 0


@pytest.mark.parametrize("policy, options", POLICIES, ids=[p for p, _ in POLICIES])
def test_every_step_scores_with_period_one_and_a_long_period_on_changes_only(
    policy, options, model_and_prompt
):
    model, ids = model_and_prompt
    decoder, scored = decode(model, ids, policy, options, every=1)
    groups = len(decoder.tier.layer_groups)
    assert SparseConfig().reselect_every == 4
    assert scored == [groups] * STEPS
    decoder, scored = decode(model, ids, policy, options, every=100)
    chosen = choice_steps(decoder, 100)
    assert scored == [groups if step in chosen else 0 for step in range(STEPS)] and len(chosen) < STEPS // 2


@pytest.mark.parametrize("every", [0, -2, True, 1.5])
def test_bad_period(every):
    with pytest.raises(ValueError, match="reselect_every must be"):
        SparseConfig(reselect_every=every)


@pytest.mark.parametrize(
    "label, parsed",
    [
        ("keykey", ("keykey", None)),
        ("keykey+every1", ("keykey", 1)),
        ("keykey+every2", ("keykey", 2)),
        ("probe+dense0,1+every4", ("probe+dense0,1", 4)),
        ("probe:rescore=2.0+every3", ("probe:rescore=2.0", 3)),
    ],
)
def test_bench_label_suffix(label, parsed):
    assert split_reselect_period(label) == parsed


@pytest.mark.parametrize("label", ["keykey+every0", "keykey+everyx", "keykey+every"])
def test_bad_bench_label(label):
    with pytest.raises(ValueError, match="reselect_every of run label"):
        validate_labels([label])


@pytest.mark.parametrize(
    "label, every, dense", [("keykey+dense0+every2", 2, (0,)), ("keykey+every1", 1, ()), ("keykey", 4, ())]
)
def test_bench_label_reaches_the_decoder(label, every, dense, make_tiny_engine):
    engine = make_tiny_engine("llama")
    decoder = make_decoder(engine, label, 0.1, {})
    assert decoder.config.reselect_every == every and decoder.config.dense_layers == dense
