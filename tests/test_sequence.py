"""Sampling, stopping and streaming: ``semkv/sequence.py`` alone and through the engine's steps.

Injected: fixed logits sampled many times at a temperature and a nucleus; tiny-model generations with
temperature, top_p and seeds; an EOS id that greedy decoding reaches at a known step; streaming
callbacks that record when they are called and that stop the generation.
Must happen: sampled frequencies follow softmax(logits / T) (renormalised over the top_p nucleus, and
nothing outside it); greedy ignores the seed; the same seed gives the same tokens and another seed
others; every sampled token lies in its step's nucleus; ``stop_at_eos`` ends at the EOS (not
returned, not streamed) and without it decoding runs to ``max_new_tokens``; ``on_token`` gets each
token right after it is sampled (the first before the prompt is stored), and returning False stops
the generation there.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from semkv.request import GenerateRequest
from semkv.sequence import SamplingError, row_maxima, sample_token
from semkv.store.keys import prefix_block_keys
from tests.conftest import tiny_hf_model

PROMPT = "The committee met on Tuesday to review the budget for the new library. What did it decide?"
LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])
DRAWS = 10_000


def frequencies(temperature: float, top_p: float, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = Counter(sample_token(LOGITS, temperature, top_p, generator) for _ in range(DRAWS))
    return torch.tensor([counts[i] / DRAWS for i in range(LOGITS.numel())])


def test_temperature_sampling_follows_the_softmax():
    for temperature in (0.5, 2.0):
        expected = torch.softmax(LOGITS / temperature, dim=0)
        torch.testing.assert_close(frequencies(temperature, 1.0), expected, atol=0.02, rtol=0)


def test_top_p_samples_only_the_nucleus_renormalised():
    probs = torch.softmax(LOGITS, dim=0)  # 0.644, 0.237, 0.087, 0.032: the nucleus at 0.7 is {0, 1}
    expected = torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(2)])
    got = frequencies(1.0, 0.7)
    torch.testing.assert_close(got, expected, atol=0.02, rtol=0)
    assert got[2:].sum() == 0.0
    assert frequencies(1.0, 0.5).tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token alone reaches 0.5


def test_greedy_is_the_argmax_whatever_the_generator():
    for seed in range(5):
        assert sample_token(LOGITS.flip(0), 0.0, 0.3, torch.Generator().manual_seed(seed)) == 3


def test_batched_maxima_sample_what_each_row_alone_samples():
    """A batched step's one reduction (``row_maxima``) must give each row the token its own sampling
    gives: greedy takes the first of tied maxima, a seeded draw is the same draw, and a row of NaN or
    -inf logits still raises for that row alone."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1  # a tie: the first index wins, as argmax's
    logits[4] = float("nan")
    logits[5] = float("-inf")
    maxima = row_maxima(logits)
    assert maxima[1][1] == 7
    for row, maximum in zip(logits[:4], maxima[:4], strict=True):
        for temperature, top_p in ((0.0, 1.0), (0.8, 0.9), (1.5, 1.0)):
            alone = sample_token(row, temperature, top_p, torch.Generator().manual_seed(11))
            batched = sample_token(row, temperature, top_p, torch.Generator().manual_seed(11), maximum)
            assert batched == alone
    for row, maximum in zip(logits[4:], maxima[4:], strict=True):
        with pytest.raises(SamplingError):
            sample_token(row, 0.0, 1.0, torch.Generator(), maximum)


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """The smallest set of top tokens whose probability reaches ``top_p``."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    values, order = torch.sort(probs, descending=True)
    size = int((torch.cumsum(values, -1) < top_p).sum()) + 1
    return set(order[:size].tolist())


def test_seeded_sampling_through_the_engine(make_tiny_engine):
    engine = make_tiny_engine("llama")
    options = dict(prompt=PROMPT, max_new_tokens=10, stop_at_eos=False, store_prompt=False, temperature=1.0)
    first = engine.generate(seed=1, **options).token_ids
    assert engine.generate(seed=1, **options).token_ids == first
    assert engine.generate(seed=2, **options).token_ids != first
    greedy = engine.generate(prompt=PROMPT, max_new_tokens=10, stop_at_eos=False, store_prompt=False)
    assert engine.generate(**{**options, "temperature": 0.0, "seed": 5}).token_ids == greedy.token_ids
    assert first != greedy.token_ids


def test_every_sampled_token_is_in_its_nucleus(make_tiny_engine):
    engine = make_tiny_engine("llama")
    temperature, top_p = 0.02, 0.6  # a peaked distribution: small nuclei
    request = GenerateRequest(
        prompt=PROMPT, max_new_tokens=12, stop_at_eos=False, store_prompt=False,
        temperature=temperature, top_p=top_p, seed=3,
    )  # fmt: skip
    seq = engine.prefill(request)
    steps = [(seq.first_logits, seq.tokens[0])]
    for _ in range(request.max_new_tokens - 1):
        logits = engine.decode_step(seq)
        steps.append((logits, seq.tokens[-1]))
    sizes = []
    for logits, token in steps:
        allowed = nucleus(logits, temperature, top_p)
        assert token in allowed
        sizes.append(len(allowed))
    assert max(sizes) < len(engine.tokenizer) // 10, sizes  # the check is not vacuous


def test_stop_at_eos(make_tiny_engine, tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    options = dict(prompt=PROMPT, max_new_tokens=10, store_prompt=False)
    free = make_tiny_engine("llama", hf_model=model).generate(stop_at_eos=False, **options).token_ids
    stop = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, free[stop]]  # EOS reached at step `stop`
    engine = make_tiny_engine("llama", hf_model=model)
    assert free[stop] in engine.eos_ids
    streamed: list[int] = []
    ended = engine.generate(stop_at_eos=True, on_token=streamed.append, **options)
    assert ended.token_ids == streamed == free[:stop]  # the EOS is neither returned nor streamed
    assert ended.stats["finish_reason"] == "eos" and ended.stats["generated_tokens"] == stop
    running = engine.generate(stop_at_eos=False, **options)
    assert running.token_ids == free and running.stats["finish_reason"] == "length"


def test_on_token_streams_each_token_as_it_is_sampled(make_tiny_engine):
    engine = make_tiny_engine("llama")
    request = GenerateRequest(prompt=PROMPT, max_new_tokens=6, stop_at_eos=False, store_prompt=False)
    seq = engine.prefill(request)
    calls: list[tuple[int, int]] = []
    engine.decode(seq, on_token=lambda token: calls.append((token, len(seq.tokens))))
    assert [token for token, _ in calls] == seq.tokens
    assert [sampled for _, sampled in calls] == list(range(1, 7))  # token i handed over before step i + 1

    keys = prefix_block_keys(engine.fingerprint, engine.config.block_size, seq.layout.token_ids)
    stored_at_first_token: list[bool] = []

    def first_token_before_store(token: int) -> None:
        if not stored_at_first_token:
            stored_at_first_token.append(engine.store.contains(keys[0]))

    engine.generate(prompt=PROMPT, max_new_tokens=2, on_token=first_token_before_store)
    assert stored_at_first_token == [False] and engine.store.contains(keys[0])


@pytest.mark.parametrize("stop_after", [1, 3])
def test_on_token_returning_false_stops_the_generation(make_tiny_engine, stop_after):
    engine = make_tiny_engine("llama")
    options = dict(prompt=PROMPT, max_new_tokens=8, stop_at_eos=False, store_prompt=False)
    free = engine.generate(**options).token_ids
    seen: list[int] = []

    def on_token(token: int) -> bool | None:
        seen.append(token)
        return False if len(seen) == stop_after else None  # None (and True) go on

    stopped = engine.generate(on_token=on_token, **options)
    assert stopped.token_ids == seen == free[:stop_after]
    assert stopped.stats["finish_reason"] == "stop" and stopped.stats["generated_tokens"] == stop_after
