"""Failure mode: a request whose temperature is so small that ``logits / temperature`` overflows float32
decodes in the same steps as another request.

Injected: the hostile request's temperature is derived from its own greedy run on the tiny model: just
above its first token's largest logit over float32's largest number (so its first token samples), below a
later step's (so the old sampler's ``logits / temperature`` is +inf there and ``torch.multinomial``
raises inside the batched step). Must happen: the sampler works in log space, so the hostile request
decodes (its tokens are the greedy ones) and ends normally; the innocent request beside it gets exactly
its tokens alone and ends normally. On the old sampler the batched step raised and ended both.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from semkv.request import GenerateRequest
from tests.reliability.isolation import (
    HOSTILE,
    INNOCENT,
    INNOCENT_REQUEST,
    alone,
    assert_unharmed,
    hostile_request,
    run_together,
)

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
STEPS = 16


def greedy_top_logits(engine, request: GenerateRequest) -> list[float]:
    """The largest logit of each step of the request's greedy decode (first token first)."""
    seq = engine.prefill(request)
    tops = [float(seq.first_logits.max())]
    for _ in range(request.max_new_tokens - 1):
        tops.append(float(engine.decode_step(seq).max()))
    return tops


def test_underflowing_temperature_fails_no_one(make_tiny_engine):
    engine = make_tiny_engine("llama")
    greedy = hostile_request(max_new_tokens=STEPS)
    tops = greedy_top_logits(engine, greedy)
    first, later = tops[0], max(tops[1:])
    assert later > 1.01 * first > 0, "the prompt must reach a larger logit after its first token"
    temperature = 1.005 * first / FLOAT32_MAX  # the first token's logits / T are finite, a later step's not
    assert float(torch.tensor(later) / temperature) == float("inf")
    hostile = replace(greedy, temperature=temperature, seed=1)
    solo = alone(engine)
    expected = alone(engine, greedy).token_ids

    outcomes = run_together(engine, {INNOCENT: INNOCENT_REQUEST, HOSTILE: hostile})

    assert_unharmed(outcomes[INNOCENT], solo)
    assert outcomes[HOSTILE].error is None and outcomes[HOSTILE].finish_reason == "length"
    assert outcomes[HOSTILE].token_ids == expected  # a temperature this small is greedy
