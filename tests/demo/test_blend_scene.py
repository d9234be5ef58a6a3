"""The demo's blend scene on the real SmolLM2: its question is one the model answers under full prefill
(the scene once showed full prefill and blend both answering "Tokyo" where the document said Zagreb),
and the scene shows each selector's answer, whether it is right, and its recomputed tokens."""

from __future__ import annotations

import pytest

from semkv.demo import blend as scene
from semkv.evaluation.metrics import exact_match


@pytest.mark.real_model
def test_demo_question_is_answered_under_full_prefill(make_smol_engine):
    """The scene's case under full prefill, as the scene sends it: the answer is in the generation."""
    engine = make_smol_engine(kv_dtype="float16")
    case = scene.demo_case()
    assert case.answer in case.chunks[case.gold[0]]
    g = engine.generate(
        messages=case.messages(),
        chunks=list(case.chunks),
        reuse="none",
        max_new_tokens=scene.MAX_NEW_TOKENS,
        store_prompt=False,
    )
    assert exact_match(g.text, case.answer), g.text


@pytest.mark.real_model
@pytest.mark.slow
def test_blend_scene_shows_each_selector(make_smol_engine, capsys):
    """The whole scene: every selector's row with its verdict, and its recomputed tokens marked."""
    result = scene.run(make_smol_engine(kv_dtype="float16"))
    assert result["correct"]["full prefill"], result["answers"]["full prefill"]
    assert set(result["answers"]) == {"full prefill", *(f"{name} {scene.RATIO}" for name in scene.SELECTORS)}
    printed = capsys.readouterr().out
    for name in scene.SELECTORS:
        assert f"--- {name} {scene.RATIO}:" in printed
        assert "[[" in printed.split(f"--- {name} {scene.RATIO}:")[1]
    for label, correct in result["correct"].items():
        assert correct == exact_match(result["answers"][label], scene.demo_case().answer), label
