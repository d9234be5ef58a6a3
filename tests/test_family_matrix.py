"""Every supported family through every path: one parametrized matrix over tiny random models.

Families: ``TINY_FAMILIES`` (Llama, Qwen2, Mistral, Gemma 3 — the Gemma config has a
sliding layer with a window of 8 and a global layer, so every prompt here runs far past
the window). Each path is checked with its issue's exactness criterion, against HF or
against full prefill / dense decoding on the same engine:

* prefill + decode: last prompt logits == HF (fp32, within what two kernels' summation orders may leave:
  :mod:`tests.tolerances`), greedy tokens == HF ``generate``;
* prefix reuse: the same prompt again, and a longer one sharing its blocks, reuse stored
  blocks and give the full-prefill logits and tokens;
* blend at ``recompute_ratio=1.0`` == full prefill of the same layout;
* share recomputing every row (constant ratio 1.0) == full prefill of the edited prompt;
* every sparse policy at a budget covering every block, through the fast-tier gather path
  (``dense_when_covered=False``) == dense (engine decode and teacher-forced logits).

Every check runs on every available device (the ``device`` fixture: cpu, and cuda where there is one;
the HF reference runs on the same device) and in both compute dtypes: float32 (the criteria above) and bfloat16, where each
path runs in bf16 end to end and logits must agree within ``ATOL_BF16`` (HF's reference stays
fp32; tokens are compared in fp32 only). A missing causal mask in the bf16 kernel moves these
logits by 0.04-0.77, bf16 rounding by < 0.006.
"""

from __future__ import annotations

import pytest
import torch

from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.request import GenerateRequest
from semkv.reuse.options import ShareConfig
from semkv.sparse import POLICIES, SparseConfig, SparseDecoder, make_policy
from tests.conftest import TINY_FAMILIES, tiny_hf_model
from tests.tolerances import config_atol

ATOL_BF16 = 2e-2
DTYPES = ["float32", "bfloat16"]
NEW_TOKENS = 8
PROMPT = (
    "The committee met on Tuesday to review the budget for the new library. Members argued about the "
    "roof, the heating system and the children's reading room, and agreed to ask the architect for a "
    "cheaper design before the next meeting in March. What did the committee agree to do?"
)
CHUNKS = [
    "Marta grew tomatoes on her balcony every summer and gave most of them to her neighbours.",
    "The old bridge over the river was closed in 1998 after a flood weakened its stone pillars.",
]
QUESTION = "When was the old bridge closed, and why?"
EDITED = PROMPT.replace("the roof, the heating system", "the windows, the lifts")


@pytest.fixture(params=TINY_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(params=DTYPES)
def dtype(request) -> str:
    return request.param


def _atol(dtype: str, engine: Engine, reference: torch.Tensor, context: int) -> float:
    """fp32: what two kernels' summation orders may leave at ``reference``'s scale over ``context`` rows
    (:mod:`tests.tolerances`); bf16: ``ATOL_BF16``."""
    if dtype != "float32":
        return ATOL_BF16
    return config_atol(reference.float(), engine.hf_model.config, context=context)


def _same(a, b, engine: Engine, dtype: str = "float32") -> None:
    """Two generations agree: first logits within the dtype's tolerance, identical tokens (fp32)."""
    torch.testing.assert_close(
        a.first_logits,
        b.first_logits,
        atol=_atol(dtype, engine, b.first_logits, b.stats["prompt_tokens"]),
        rtol=0,
    )
    if dtype == "float32":
        assert a.token_ids == b.token_ids


def _run(engine, **kw):
    return engine.generate(max_new_tokens=NEW_TOKENS, stop_at_eos=False, **kw)


def test_prefill_and_decode_match_hf(family, dtype, device, make_tiny_engine):
    engine = make_tiny_engine(family, disk=False, compute_dtype=dtype, device=device)
    assert engine.runtime.compute_dtype == getattr(torch, dtype)
    g = _run(engine, prompt=PROMPT, reuse="none")
    ids = engine.layout(GenerateRequest(prompt=PROMPT)).token_ids
    model = engine.hf_model
    with torch.no_grad():
        reference = model(torch.tensor([ids], device=device)).logits[0, -1]
    expected = model.generate(
        torch.tensor([ids], device=device),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    torch.testing.assert_close(
        g.first_logits, reference, atol=_atol(dtype, engine, reference, len(ids)), rtol=0
    )
    if dtype == "float32":
        assert g.token_ids == expected


def test_prefix_reuse_is_exact(family, dtype, device, make_tiny_engine):
    engine = make_tiny_engine(family, disk=False, compute_dtype=dtype, device=device)
    longer = PROMPT + " Answer in one short sentence, please."
    full_longer = _run(engine, prompt=longer, reuse="none", store_prompt=False)
    first = _run(engine, prompt=PROMPT, reuse="none")  # stores its blocks
    again = _run(engine, prompt=PROMPT, reuse="prefix")
    assert again.stats["path"] == "prefix" and again.stats["reused_tokens"] > 0
    _same(again, first, engine, dtype)
    extended = _run(engine, prompt=longer, reuse="prefix")
    assert extended.stats["path"] == "prefix" and extended.stats["reused_tokens"] > 0
    _same(extended, full_longer, engine, dtype)


def test_blend_at_full_ratio_is_full_prefill(family, dtype, device, make_tiny_engine):
    engine = make_tiny_engine(family, disk=False, compute_dtype=dtype, device=device)
    engine.add_chunks(CHUNKS)
    full = _run(engine, prompt=QUESTION, chunks=CHUNKS, reuse="none", store_prompt=False)
    blend = _run(
        engine, prompt=QUESTION, chunks=CHUNKS, reuse="blend", recompute_ratio=1.0, store_prompt=False
    )
    assert blend.stats["path"] == "blend"
    _same(blend, full, engine, dtype)


def test_share_recomputing_everything_is_full_prefill(family, dtype, device, make_tiny_engine):
    engine = make_tiny_engine(family, disk=False, compute_dtype=dtype, device=device)
    config = ShareConfig(
        min_tokens=16, min_aligned_after_prefix=8, schedule="constant", constant_ratio=1.0, layer0_window=0
    )
    _run(engine, prompt=PROMPT, reuse="none", share=config)  # remembered for sharing
    full = _run(engine, prompt=EDITED, reuse="none", store_prompt=False)
    shared = _run(engine, prompt=EDITED, reuse="share", share=config, store_prompt=False)
    assert shared.stats["path"] == "share", shared.stats.get("refused")
    _same(shared, full, engine, dtype)


@pytest.fixture(scope="module")
def dense_runs(tmp_path_factory, tokenizer):
    """Per family, compute dtype and device (built once): an engine, its dense generation and its dense
    per-step decode logits."""
    runs: dict[tuple[str, str, str], tuple] = {}

    def get(family: str, dtype: str, device: str):
        if (family, dtype, device) not in runs:
            config = EngineConfig(
                model=family,
                home=tmp_path_factory.mktemp(family),
                kv_dtype="float32",
                block_size=4,
                store=StoreConfig(disk=False),
                compute_dtype=dtype,
                device=device,
            )
            model = tiny_hf_model(family, len(tokenizer)).to(device)
            engine = Engine(config, model, tokenizer, name=f"tiny-{family}")
            dense = _run(engine, prompt=PROMPT, reuse="none", store_prompt=False)
            runs[family, dtype, device] = (engine, dense, _teacher_forced(engine, dense.token_ids, None))
        return runs[family, dtype, device]

    return get


def _teacher_forced(engine, tokens: list[int], decoder: SparseDecoder | None) -> torch.Tensor:
    """Per-step decode logits [steps, V] after a full prefill of PROMPT, feeding ``tokens``."""
    request = GenerateRequest(
        prompt=PROMPT, max_new_tokens=len(tokens) + 1, reuse="none", store_prompt=False, stop_at_eos=False
    )
    seq = engine.fork(engine.prefill(request, capture_queries=True), sparse=decoder)
    return torch.stack([engine.decode_step(seq, feed=token) for token in tokens])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_sparse_at_full_budget_is_dense(family, dtype, device, policy, dense_runs):
    """A budget covering every block through the fast tier's gather path (``dense_when_covered=False``,
    so not the dense shortcut ``kv_budget=1.0`` takes in ``generate``): free-running tokens through the
    engine's decode, and teacher-forced per-step logits."""
    engine, dense, dense_logits = dense_runs(family, dtype, device)
    config = SparseConfig(kv_budget=1.0, window_tokens=6, dense_when_covered=False)
    decoder = SparseDecoder(make_policy(policy), config, engine.config.block_size)
    request = GenerateRequest(
        prompt=PROMPT, max_new_tokens=NEW_TOKENS, reuse="none", store_prompt=False, stop_at_eos=False
    )
    seq = engine.fork(engine.prefill(request, capture_queries=True), sparse=decoder)
    engine.decode(seq)
    _same(engine.finish(seq), dense, engine, dtype)
    if policy != "dense":  # blocks were copied into the fast tier (the dense shortcut copies none)
        assert decoder.records[0].loaded_blocks > 0 and all(r.selected for r in decoder.records)
    decoder = SparseDecoder(make_policy(policy), config, engine.config.block_size)
    torch.testing.assert_close(
        _teacher_forced(engine, dense.token_ids, decoder),
        dense_logits,
        atol=_atol(dtype, engine, dense_logits, dense.stats["prompt_tokens"] + NEW_TOKENS),
        rtol=0,
    )
    if policy != "dense":
        assert decoder.records and all(r.selected for r in decoder.records)
