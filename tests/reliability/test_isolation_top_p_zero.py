"""Failure mode: a request whose ``top_p`` is 0 in float32 (1e-46: the engine admits any value in (0, 1])
decodes in the same steps as another request.

Injected: the hostile request samples at temperature 1 with top_p 1e-46. Must happen: the nucleus always
keeps the most likely token, so the hostile request decodes greedily and ends normally (the old sampler
kept no token, divided zeros by their zero sum and ``torch.multinomial`` raised: a 500 for the request
itself); the innocent request beside it gets exactly its tokens alone and ends normally.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tests.reliability.isolation import (
    HOSTILE,
    INNOCENT,
    INNOCENT_REQUEST,
    alone,
    assert_unharmed,
    hostile_request,
    run_together,
)

TOP_P = 1e-46


def test_top_p_zero_in_float32_is_greedy_and_fails_no_one(make_tiny_engine):
    assert float(torch.tensor(TOP_P, dtype=torch.float32)) == 0.0
    engine = make_tiny_engine("llama")
    greedy = hostile_request(max_new_tokens=10)
    hostile = replace(greedy, temperature=1.0, top_p=TOP_P, seed=5)
    solo = alone(engine)
    expected = alone(engine, greedy).token_ids

    outcomes = run_together(engine, {INNOCENT: INNOCENT_REQUEST, HOSTILE: hostile})

    assert_unharmed(outcomes[INNOCENT], solo)
    assert outcomes[HOSTILE].error is None and outcomes[HOSTILE].finish_reason == "length"
    assert outcomes[HOSTILE].token_ids == expected
