"""A warm-up request when the server starts, so that its first user does not pay the process's one-time costs.

A fresh ``semkv serve`` answered its first long request much more slowly than the next ones: the one-time
work of a process's first request
(kernel set-up for each new matrix shape, the heap growing to its working size, the engine thread's thread
pool, the store's and the reuse paths' first use). :func:`warm_up` runs one request of a synthetic prompt
through the engine's scheduler (``add_request`` / ``step``: chunked prefill, decode, sampling, storing its
prompt, as a real request) before the server takes traffic. Its KV is stored under its own cache salt
(:data:`WARMUP_REQUEST_ID`, default tenant): a client's lookups find it only by sending that salt, and then
find only the synthetic sentence (with API keys, no tenant's namespace is the default one); it takes ~600
tokens of KV in the store, the same entries on every start. On a
restart over the same disk tier the warm-up finds its prompt there (a prefix hit: it then warms the store's
read path more than the model). A warm-up with nothing stored and full prefill only (``reuse="none"``,
``store_prompt=False``) did not help (docs/history/measurements.md). Its writes reach every tier of the
store, Redis included, and show in the store's counters in ``/metrics``; its request and steps do not (they
run inside an engine-loop job, not the loop's own steps). ``--warmup-tokens 0`` turns it off.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from semkv.request import GenerateRequest
from semkv.validation import check_int

WARMUP_SENTENCE = "The ships were counted at the harbour before the storm came in from the west. "
WARMUP_REQUEST_ID = "semkv-warmup"


def check_warmup_tokens(tokens: object) -> int:
    """``tokens`` as an int >= 1 (no upper bound here: the warm-up is cut to the model's context)."""
    return check_int("warm-up tokens", tokens, 1, sys.maxsize)


def warmup_request(sentences: int) -> GenerateRequest:
    """A request whose prompt is :data:`WARMUP_SENTENCE` ``sentences`` times, with 2 new tokens, in the
    namespace of its own cache salt."""
    return GenerateRequest(prompt=WARMUP_SENTENCE * sentences, max_new_tokens=2, cache_salt=WARMUP_REQUEST_ID)


def warmup_request_for(engine: Any, tokens: int) -> GenerateRequest:
    """:func:`warmup_request` of about ``tokens`` prompt tokens in ``engine``'s tokenizer, cut to half the
    model's context (the chat template's tokens come on top)."""
    wanted = min(check_warmup_tokens(tokens), engine.max_context // 2)
    return warmup_request(max(1, wanted // engine.count_tokens([WARMUP_SENTENCE])[0]))


@dataclass(frozen=True)
class WarmUp:
    """A finished warm-up: its wall seconds and the prompt tokens it prefilled."""

    seconds: float
    prompt_tokens: int


def warm_up(engine: Any, tokens: int) -> WarmUp:
    """Run :func:`warmup_request` through ``engine``'s scheduler to its end, on the calling thread (the
    engine thread: its thread pool and its memory are the ones that warm up). Call it before any other
    request is added: it steps the engine until nothing is unfinished. Raises the request's error if it
    ended with one (it should not: a real request would fail too)."""
    request = warmup_request_for(engine, tokens)
    start = time.perf_counter()
    engine.add_request(request, request_id=WARMUP_REQUEST_ID)
    final = None
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == WARMUP_REQUEST_ID and output.finished:
                final = output
    seconds = time.perf_counter() - start
    if final is None or final.error is not None or final.generation is None:
        reason = None if final is None else final.finish_reason
        raise RuntimeError(f"the warm-up request did not finish normally ({reason})") from (
            None if final is None else final.error
        )
    return WarmUp(seconds, int(final.generation.stats.get("prompt_tokens", 0)))
