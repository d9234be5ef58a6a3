"""The server's start-up warm-up request (``semkv.server.warmup``, ``semkv serve --warmup-tokens``).

Injected: a warm-up run on a tiny engine with a fresh store, then a user's request for the very same prompt;
bad token counts; a model whose context is shorter than the asked warm-up. Must happen: the warm-up runs
through the scheduler to its end (nothing left unfinished) and stores its prompt, but under its own cache
salt, so the user's request finds none of it; a bad count is a ValueError naming the field or flag; a short
context shortens the warm-up instead of failing the start.
"""

from __future__ import annotations

import pytest

from semkv.cli import build_parser
from semkv.server import command
from semkv.server.warmup import check_warmup_tokens, warm_up, warmup_request_for


def test_warm_up_runs_to_its_end_and_no_user_finds_its_kv(make_tiny_engine):
    engine = make_tiny_engine("llama")
    done = warm_up(engine, 200)
    assert done.seconds > 0 and 180 <= done.prompt_tokens <= 260
    assert not engine.has_unfinished()
    engine.store.flush()
    assert list(engine.store.memory.keys())  # it stored its prompt, as a real request does
    same = engine.generate(warmup_request_for(engine, 200).prompt, max_new_tokens=2)
    assert same.stats["reused_tokens"] == 0, same.stats


def test_a_short_context_shortens_the_warm_up(make_tiny_engine):
    engine = make_tiny_engine("llama")
    engine.max_context = 64  # a model with a 64-token context
    assert warm_up(engine, 600).prompt_tokens <= 64
    assert not engine.has_unfinished()


@pytest.mark.parametrize("tokens", [0, -5, True, 2.5, "600"])
def test_a_bad_token_count_is_refused(tokens):
    with pytest.raises(ValueError, match="warm-up tokens"):
        check_warmup_tokens(tokens)


def test_serve_refuses_a_negative_warmup_flag():
    args = build_parser().parse_args(["serve", "--warmup-tokens", "-1"])
    with pytest.raises(ValueError, match="--warmup-tokens"):
        command.run(args)
