"""SemShareKV: matching and rearrangement on hand-made sequences, then the path end to end on
tiny random models (KV float32): recompute-everything equals full prefill, an identical prompt
equals an exact hit, an unrelated prompt is refused and fully prefilled."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from semkv.evaluation.essays import haystack
from semkv.evaluation.metrics import logit_kl
from semkv.models.adapters import apply_rope
from semkv.models.staging import RowSource
from semkv.request import GenerateRequest
from semkv.reuse.options import ShareConfig
from semkv.reuse.share import (
    ALIGNED,
    SAME_TOKEN,
    SIGNATURE,
    UNMATCHED,
    align_runs,
    match_signatures,
    match_tokens,
)
from semkv.store.keys import EntryKind, prompt_key
from tests.conftest import tiny_hf_model

REF = list(range(100, 140))  # 40 distinct token ids


# -- matching on hand-made sequences -------------------------------------------------------------------
def test_align_substitution_keeps_alignment():
    new = list(REF)
    new[8:10] = [900, 901]
    source, _ = align_runs(new, REF, anchor=4)
    expect = list(range(40))
    expect[8:10] = [-1, -1]
    assert source.tolist() == expect


def test_align_insertion_and_deletion():
    inserted = REF[:10] + [900, 901, 902] + REF[10:]
    source, _ = align_runs(inserted, REF, anchor=4)
    assert source.tolist() == list(range(10)) + [-1, -1, -1] + list(range(10, 40))
    deleted = REF[:5] + REF[15:]
    source, _ = align_runs(deleted, REF, anchor=4)
    assert source.tolist() == list(range(5)) + list(range(15, 40))


def test_align_moved_block():
    moved = REF[20:] + REF[:20]
    source, _ = align_runs(moved, REF, anchor=4)
    assert source.tolist() == list(range(20, 40)) + list(range(20))


def test_align_repeated_anchor_prefers_the_nearest_occurrence():
    ref = [1, 2, 3, 4, 50, 51, 52, 53, 1, 2, 3, 4, 60]
    new = [7, 50, 51, 52, 53, 1, 2, 3, 4, 60]  # aligned with offset +3: the second [1,2,3,4]
    source, _ = align_runs(new, ref, anchor=4)
    assert source.tolist() == [-1, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def test_match_tokens_kinds():
    ref = list(range(100, 140))
    new = list(ref)
    new[10] = 130  # same id as ref[30], not in an aligned run -> SAME_TOKEN (nearest occurrence)
    new[20] = 999  # id absent from the reference -> signature step
    bits_ref = torch.zeros(40, 8, dtype=torch.bool)
    bits_ref[25] = True  # only ref[25] looks like the new token 20
    bits_new = torch.zeros(40, 8, dtype=torch.bool)
    bits_new[20] = True
    match = match_tokens(new, ref, bits_new, bits_ref, anchor=4, min_token_similarity=0.9)
    assert match.source[10] == 30 and match.kind[10] == SAME_TOKEN
    assert match.source[20] == 25 and match.kind[20] == SIGNATURE
    assert (match.kind == ALIGNED).sum() == 38
    assert match.exact_prefix == 10
    assert match.match_rate == 1.0 and match.aligned_rate == 38 / 40
    unlike = torch.zeros(40, 8, dtype=torch.bool)  # no reference token agrees on any bit
    strict = match_tokens(new, ref, bits_new, unlike, anchor=4, min_token_similarity=0.9)
    assert strict.kind[20] == UNMATCHED and strict.source[20] == -1


def test_match_signatures_threshold():
    new_bits = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    ref_bits = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    source = np.array([-1, -1])
    found = match_signatures(new_bits, ref_bits, source, min_similarity=0.75)
    assert source.tolist() == [0, -1] and found.tolist() == [True, False]


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_gathered_rows_load_as_the_rearranged_copy(make_tiny_engine, kv_dtype):
    """A share load gathers the reference's rows layer by layer straight into the cache
    (``RowSource.gathered``): every row holds what loading the rearranged copy holds (rows of source -1
    zero before any forward writes them), keys re-rotated to the new positions, bit for bit."""
    engine = make_tiny_engine("llama", kv_dtype=kv_dtype, compute_dtype="bfloat16")
    runtime = engine.runtime
    layers, heads, dim = runtime.num_layers, runtime.adapter.num_kv_heads, runtime.adapter.head_dim
    stored = torch.Generator().manual_seed(0)
    k = torch.randn(layers, heads, 9, dim, generator=stored).to(runtime.kv_dtype)
    v = torch.randn(layers, heads, 9, dim, generator=stored).to(runtime.kv_dtype)
    source = torch.tensor([4, -1, 0, 0, 8, 7, -1])
    positions = torch.arange(3, 10)
    ids = list(range(7))

    def rearranged(kv: torch.Tensor) -> torch.Tensor:
        out = kv.index_select(2, source.clamp_min(0))
        out[:, :, source < 0] = 0
        return out

    copied, gathered = runtime.new_cache(16), runtime.new_cache(16)
    runtime.load_rows(copied, rearranged(k), rearranged(v), positions, ids)
    runtime.load_pieces(gathered, [RowSource.gathered(k, v, source)], positions, ids)
    for layer in range(layers):
        assert torch.equal(gathered.k_pre[layer][:, :7], copied.k_pre[layer][:, :7])
        assert torch.equal(gathered.keys(layer, 7), copied.keys(layer, 7))
        assert torch.equal(gathered.values(layer, 7), copied.values(layer, 7))
        assert bool((gathered.values(layer, 7)[:, [1, 6]] == 0).all())
    with pytest.raises(ValueError, match="row order"):
        RowSource.gathered(k, v, torch.tensor([9]))


def test_share_config_schedules_and_validation():
    decay = ShareConfig(first_ratio=0.4, decay=0.5, min_ratio=0.05).ratios(6)
    assert decay == {1: 0.4, 2: 0.2, 3: 0.1, 4: 0.05, 5: 0.05}
    assert ShareConfig(schedule="constant", constant_ratio=0.1).ratios(3) == {1: 0.1, 2: 0.1}
    for bad, message in (
        (dict(first_ratio=1.5), r"first_ratio must be a number in \[0, 1\]"),
        (dict(schedule="linear"), "schedule must be one of 'exponential', 'constant'"),
        (dict(unmatched="keep"), "unmatched must be one of 'recompute', 'drop'"),
        (dict(decay=0), "decay must be in"),
        (dict(min_match_rate=-0.1), r"min_match_rate must be a number in \[0, 1\]"),
    ):
        with pytest.raises(ValueError, match=message):
            ShareConfig(**bad)
    assert GenerateRequest(prompt="x", share={"min_tokens": 8}).share.min_tokens == 8
    with pytest.raises(ValueError, match="share must be a ShareConfig or a dict"):
        GenerateRequest(prompt="x", share=3)


# -- the path end to end ---------------------------------------------------------------------------------
@pytest.fixture
def doc(tokenizer) -> str:
    return haystack(tokenizer, 160, start_essay=2)


@pytest.fixture
def engine4(make_tiny_engine, tokenizer):
    """A 4-layer tiny llama (so selection at layers 1-2 matters for the last layer's output)."""
    return make_tiny_engine("llama", hf_model=tiny_hf_model("llama", len(tokenizer), num_hidden_layers=4))


def _paraphrase(doc: str) -> tuple[str, str]:
    return (
        "Summarise the following text.\n\n" + doc,
        "Please write a brief summary of this document.\n\n" + doc,
    )


def test_recompute_everything_equals_full_prefill(engine4, doc):
    reference, target = _paraphrase(doc)
    engine4.generate(prompt=reference, max_new_tokens=1)
    full = engine4.generate(prompt=target, max_new_tokens=4, reuse="none", store_prompt=False)
    every = ShareConfig(schedule="constant", constant_ratio=1.0, layer0_window=0)
    shared = engine4.generate(prompt=target, max_new_tokens=4, reuse="share", share=every, store_prompt=False)
    assert shared.stats["path"] == "share"
    assert shared.stats["share_exact_prefix"] > 0 and shared.stats["share_match_rate"] > 0.9
    torch.testing.assert_close(shared.first_logits, full.first_logits, atol=1e-4, rtol=1e-4)
    assert shared.token_ids == full.token_ids


def test_default_schedule_reuses_and_reports(engine4, doc):
    reference, target = _paraphrase(doc)
    engine4.generate(prompt=reference, max_new_tokens=1)
    full = engine4.generate(prompt=target, max_new_tokens=1, reuse="none", store_prompt=False)
    shared = engine4.generate(prompt=target, max_new_tokens=1, reuse="share", store_prompt=False)
    s = shared.stats
    assert (
        s["path"] == "share"
        and s["share_reference"] == prompt_key(engine4.fingerprint, _ids(engine4, reference))[:16]
    )
    rows = s["share_layer_rows"]
    after_prefix = s["prompt_tokens"] - s["share_exact_prefix"]
    assert rows[0] == s["share_layer0_rows"] <= after_prefix
    assert rows == sorted(rows, reverse=True) and rows[-1] < after_prefix / 2
    assert s["recomputed_tokens"] < s["prompt_tokens"] / 2 and s["share_forced"] >= 1
    assert not torch.equal(shared.first_logits, full.first_logits)  # approximate: the reuse took effect


def _ids(engine, prompt: str) -> list[int]:
    return engine.layout(GenerateRequest(prompt=prompt)).token_ids


def test_identical_prompt_equals_exact_hit(make_tiny_engine, doc):
    engine = make_tiny_engine("llama")
    prompt = "Summarise the following text.\n\n" + doc
    first = engine.generate(prompt=prompt, max_new_tokens=6)
    exact = engine.generate(prompt=prompt, max_new_tokens=6, reuse="prefix", store_prompt=False)
    shared = engine.generate(prompt=prompt, max_new_tokens=6, reuse="share", store_prompt=False)
    assert exact.stats["path"] == "prefix" and shared.stats["path"] == "share"
    assert shared.stats["share_exact_prefix"] == shared.stats["prompt_tokens"] - 1
    assert shared.token_ids == exact.token_ids == first.token_ids
    torch.testing.assert_close(shared.first_logits, exact.first_logits, atol=1e-5, rtol=1e-5)


def test_unrelated_prompt_is_refused_and_exactly_prefilled(make_tiny_engine, doc, tokenizer):
    """Share refuses an unrelated prompt; the request is served exactly (the template's stored prefix
    blocks, exact reuse being always allowed, and full prefill for the rest) and says why."""
    engine = make_tiny_engine("llama")
    engine.generate(prompt="Summarise the following text.\n\n" + doc, max_new_tokens=1)
    other = "Translate into French.\n\n" + haystack(tokenizer, 160, start_essay=30)
    full = engine.generate(prompt=other, max_new_tokens=3, reuse="none", store_prompt=False)
    got = engine.generate(prompt=other, max_new_tokens=3, reuse="share", store_prompt=False)
    assert got.stats["path"] == "prefix" and got.stats["reused_tokens"] < 32  # the template only
    assert "no similar stored prompt" in got.stats["refused"]["share"]
    assert "outdone by an exact prefix hit" in got.stats["fallback"]
    torch.testing.assert_close(got.first_logits, full.first_logits, atol=1e-5, rtol=1e-5)


def test_rearranged_kv_lands_at_new_positions(engine4, doc):
    """With nothing recomputed after layer 1, every reused row from layer 2 on holds the reference's
    pre-RoPE K/V of its matched token, rotated to the row's new position."""
    engine = engine4
    sentences = doc.split(". ")
    half = len(sentences) // 2
    assert half >= 1
    reference = "Summarise:\n\n" + ". ".join(sentences)
    moved = "Summarise:\n\n" + ". ".join(sentences[half:] + sentences[:half])  # the halves swapped
    assert moved != reference
    engine.generate(prompt=reference, max_new_tokens=1)
    config = ShareConfig(first_ratio=0.0, min_ratio=0.0, scattered="reuse", recompute_last=1)
    request = GenerateRequest(prompt=moved, max_new_tokens=1, reuse="share", share=config)
    seq = engine.prefill(request)
    layout, plan, cache, outcome = seq.layout, seq.plan, seq.cache, seq.outcome
    assert plan.path == "share", seq.refusals
    assert not outcome.exact
    ref_entry = plan.reference
    source = torch.from_numpy(plan.match.source)
    reused = (source >= 0).clone()
    reused[-1] = False
    reused[: plan.match.exact_prefix] = False
    assert int(reused.sum()) > len(layout) // 2
    rows = reused.nonzero().squeeze(1)
    for layer in (2, 3):
        want_pre = ref_entry.k[layer][:, source[rows]]
        assert torch.equal(cache.k_pre[layer][:, rows], want_pre)
        assert torch.equal(cache.v[layer][:, rows], ref_entry.v[layer][:, source[rows]])
        cos, sin = engine.adapter.rotary(rows, layer, want_pre)
        torch.testing.assert_close(cache.k_rot[layer][:, rows], apply_rope(want_pre, cos, sin))
    assert torch.equal(cache.positions[: cache.length], torch.arange(len(layout)))


def test_auto_prefers_exact_prefix_when_it_reuses_more(make_tiny_engine, doc):
    engine = make_tiny_engine("llama")
    reference, target = _paraphrase(doc)
    engine.generate(prompt=reference, max_new_tokens=1)
    # The same conversation continued: an exact prefix hit covers it; share must not take it.
    continued = engine.generate(
        messages=[
            {"role": "user", "content": reference},
            {"role": "assistant", "content": "It is about startups."},
            {"role": "user", "content": "Shorter, please."},
        ],
        max_new_tokens=1,
        store_prompt=False,
    )
    assert continued.stats["path"] == "prefix"
    # A changed instruction before the document: only share reuses the document.
    changed = engine.generate(prompt=target, max_new_tokens=1, store_prompt=False)
    assert changed.stats["path"] == "share"
    assert changed.stats["reused_tokens"] > changed.stats["prompt_tokens"] // 2


def test_elimination_drops_unmatched_rows(engine4, doc):
    """unmatched="drop": the cache holds the exact prefix, every matched token and the last token, at
    their own positions, and nothing of the unmatched ones; decoding goes on after the last position."""
    reference, _ = _paraphrase(doc)
    engine4.generate(prompt=reference, max_new_tokens=1)
    target = "Write one sentence about this essay's key idea, in plain words.\n\n" + doc
    request = GenerateRequest(
        prompt=target,
        max_new_tokens=2,
        reuse="share",
        share=ShareConfig(unmatched="drop"),
        store_prompt=False,
    )
    seq = engine4.prefill(request)
    assert seq.plan.path == "share", seq.refusals
    ids, source = seq.layout.token_ids, seq.plan.match.source
    n = len(ids)
    prefix = min(seq.plan.match.exact_prefix, n - 1)
    kept = list(range(prefix)) + [p for p in range(prefix, n) if source[p] >= 0 or p == n - 1]
    dropped = sorted(set(range(n)) - set(kept))
    assert dropped and all(source[p] < 0 for p in dropped)
    assert seq.cache.length == len(kept) and seq.cache.positions[: len(kept)].tolist() == kept
    assert seq.cache.token_ids == [ids[p] for p in kept]
    stats = engine4.finish(seq).stats
    assert stats["share_dropped"] == len(dropped) and stats["share_unmatched"] == "drop"
    engine4.decode_step(seq)
    assert int(seq.cache.positions[seq.cache.length - 1]) == n  # the next token sits after the prompt
    recomputed = engine4.prefill(replace(request, share=ShareConfig(unmatched="recompute")))
    assert recomputed.cache.length == n and recomputed.cache.positions[:n].tolist() == list(range(n))


def test_min_match_rate_refuses_a_reference_aligned_below_it(engine4, doc):
    reference, target = _paraphrase(doc)
    engine4.generate(prompt=reference, max_new_tokens=1)
    options = dict(prompt=target, max_new_tokens=1, reuse="share", store_prompt=False)
    served = engine4.generate(**options)
    rate = served.stats["share_aligned_rate"]
    assert served.stats["path"] == "share" and ShareConfig().min_match_rate <= rate < 1.0
    at_rate = engine4.generate(**options, share=ShareConfig(min_match_rate=rate))
    assert at_rate.stats["path"] == "share"  # refused only below the rate
    above = ShareConfig(min_match_rate=min(1.0, rate + 0.005))
    refused = engine4.generate(**options, share=above)
    assert refused.stats["path"] == "prefix" and refused.stats["reused_tokens"] < 32  # the template only
    reason = refused.stats["refused"]["share"]
    assert f"aligned match rate {rate:.3f} < min_match_rate {above.min_match_rate}" in reason


def test_prompts_are_remembered_with_signatures_and_survive_a_restart(make_tiny_engine, tokenizer, doc):
    engine = make_tiny_engine("llama")
    engine.generate(prompt="Hi there", max_new_tokens=1)  # below min_tokens: not remembered
    reference, target = _paraphrase(doc)
    engine.generate(prompt=reference, max_new_tokens=1)
    index = engine.paths["share"].index
    assert len(index) == 1
    ids = _ids(engine, reference)
    entry = engine.store.get(prompt_key(engine.fingerprint, ids), ids, EntryKind.PROMPT)
    assert entry is not None and entry.extras["lsh"].shape == (len(ids), ShareConfig().simhash.tables)
    home = engine.config.home
    engine.close()
    again = _engine_at(engine, home)  # a new process: the index is read back from <home>/share_index
    got = again.generate(prompt=target, max_new_tokens=1, reuse="share", store_prompt=False)
    assert got.stats["path"] == "share"


def _engine_at(engine, home):
    from semkv.config import EngineConfig
    from semkv.engine import Engine

    config = EngineConfig(
        model="llama",
        home=home,
        kv_dtype="float32",
        block_size=engine.config.block_size,
        compute_dtype="float32",
    )
    return Engine(config, engine.hf_model, engine.tokenizer, name="tiny-llama")


def test_reference_gone_from_store_is_dropped_from_index(make_tiny_engine, doc):
    """The index points at a prompt whose KV was evicted: the plan refuses and forgets it."""
    engine = make_tiny_engine("llama")
    reference, target = _paraphrase(doc)
    engine.generate(prompt=reference, max_new_tokens=1)
    key = prompt_key(engine.fingerprint, _ids(engine, reference))
    engine.store.delete(key)
    got = engine.generate(prompt=target, max_new_tokens=1, reuse="share", store_prompt=False)
    assert got.stats["path"] == "prefix" and got.stats["reused_tokens"] < 32  # the template's blocks only
    assert "no longer in the store" in got.stats["refused"]["share"]
    assert key not in engine.paths["share"].index


def test_scattered_matches_can_be_forced_into_recompute(engine4, doc):
    reference, target = _paraphrase(doc)
    engine4.generate(prompt=reference, max_new_tokens=1)
    runs = {}
    for scattered in ("reuse", "recompute"):
        got = engine4.generate(
            prompt=target,
            max_new_tokens=1,
            reuse="share",
            share=ShareConfig(scattered=scattered),
            store_prompt=False,
        )
        runs[scattered] = got.stats
    counts = runs["reuse"]["share_matches"]
    assert counts["same_token"] + counts["signature"] > 0
    assert runs["recompute"]["share_forced"] > runs["reuse"]["share_forced"]
    assert runs["reuse"]["share_forced"] <= counts["unmatched"] + ShareConfig().recompute_last


@pytest.mark.real_model
def test_smollm2_paraphrase_served_by_share(make_smol_engine):
    """On the real model: recompute-everything (through the share path) reproduces full prefill; the
    default schedule keeps the first token of a paraphrased request (changed instruction, same document)
    and a small KL."""
    engine = make_smol_engine(kv_dtype="float32")
    doc = haystack(engine.tokenizer, 200, start_essay=5)
    engine.generate(prompt="Summarise the following essay.\n\n" + doc, max_new_tokens=1)
    target = "Write a two-sentence summary of this essay.\n\n" + doc
    full = engine.generate(prompt=target, max_new_tokens=1, reuse="none", store_prompt=False)
    every = ShareConfig(schedule="constant", constant_ratio=1.0, layer0_window=0)
    exact = engine.generate(prompt=target, max_new_tokens=1, reuse="share", share=every, store_prompt=False)
    s = exact.stats
    assert s["path"] == "share", s["refused"]
    computed = s["share_layer_rows"][0]
    assert computed == s["prompt_tokens"] - s["share_exact_prefix"] > 0.5 * s["prompt_tokens"]
    assert s["share_layer_rows"] == [computed] * engine.num_layers  # every row recomputed at every layer
    torch.testing.assert_close(exact.first_logits, full.first_logits, atol=2e-3, rtol=1e-3)
    shared = engine.generate(prompt=target, max_new_tokens=1, reuse="share", store_prompt=False)
    assert shared.stats["path"] == "share" and shared.stats["share_recompute_fraction"] < 0.3
    assert int(shared.first_logits.argmax()) == int(full.first_logits.argmax())
    assert logit_kl(full.first_logits, shared.first_logits) < 0.1


def test_a_prompt_that_only_extends_a_stored_one_is_not_remembered(make_tiny_engine, tokenizer):
    """Injected: a remembered ~600-token prompt, then the same prompt with a short question appended (a
    prefix hit on its blocks: under 10% of it computed). Must happen: the extension is neither stored
    as a PROMPT entry nor indexed (``min_new_fraction=0.1``); asked again with ``min_new_fraction=0`` it
    is; the first prompt (fully computed) was."""
    engine = make_tiny_engine("llama")
    reference = "Summarise the following text.\n\n" + haystack(tokenizer, 600, start_essay=2)
    engine.generate(prompt=reference, max_new_tokens=1)
    index = engine.paths["share"].index
    assert len(index) == 1
    extended = reference + " And who wrote it?"
    got = engine.generate(prompt=extended, max_new_tokens=1)
    ids = _ids(engine, extended)
    assert got.stats["path"] == "prefix" and 0 < got.stats["recomputed_tokens"] < 0.1 * len(ids)
    key = prompt_key(engine.fingerprint, ids)
    assert len(index) == 1 and engine.store.get(key, ids, EntryKind.PROMPT) is None
    engine.generate(prompt=extended, max_new_tokens=1, share=ShareConfig(min_new_fraction=0.0))
    assert len(index) == 2 and engine.store.get(key, ids, EntryKind.PROMPT) is not None


def test_min_new_fraction_is_validated():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_new_fraction"):
            ShareConfig(min_new_fraction=bad)
