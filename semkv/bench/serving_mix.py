"""The realistic serving mix of ``semkv bench batching --sweep``: its seeded builder, its streaming client
and its latency measures (pure helpers, tested in ``tests/bench/test_serving_mix.py``).

A load is a list of :class:`WorkItem` — one client works through an item's turns in order, so a second
turn is sent after the first one's answer — of four kinds (their share of the requests in
:data:`MIX`):

* ``rag``: a question over ``docs_per_request`` uploaded documents named by id (``reuse="auto"``:
  blend reuses the documents' precomputed KV);
* ``chat``: a passage pasted into a user turn with a question, then a follow-up turn that extends
  that conversation (first turn + the assistant's streamed answer + a new question): prefix reuse;
* ``reworded``: an instruction + a passage, then the same passage under a paraphrased instruction:
  share (SemShareKV) reuses the first prompt's KV;
* ``long``: a long passage (>= 2K tokens) and a question, decoded with a sparse policy set per request.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from semkv.bench.serve import Outcome, percentile, stream_chat

MIX: dict[str, float] = {"rag": 0.4, "chat": 0.25, "reworded": 0.25, "long": 0.1}
TURNS: dict[str, int] = {"rag": 1, "chat": 2, "reworded": 2, "long": 1}
MIN_REQUESTS = sum(TURNS.values())  # one item of every kind

RAG_QUESTIONS = [
    "What is the main argument of these passages? Answer in one sentence.",
    "Which passage is most about startups, and why?",
    "Name one piece of advice given in the passages.",
    "What do these passages say about work?",
]
CHAT_QUESTIONS = [
    "What is the author's main point in this passage?",
    "Which claim in this passage is the most surprising?",
    "What advice does this passage give?",
]
FOLLOW_UPS = [
    "Can you give an example of that from the passage?",
    "Why does the author think so?",
    "How would you explain that to a student?",
]
# (instruction, the same instruction reworded): share reuses the first prompt's KV for the second.
REWORDINGS = [
    (
        "Summarize the following passage in two sentences.",
        "Give a two-sentence summary of the passage below.",
    ),
    ("List the key ideas of this text.", "What are the main ideas in the following text? List them."),
    ("Explain what the author argues here.", "Describe the argument the author makes in this text."),
]
LONG_QUESTIONS = [
    "What are the recurring themes across these essays?",
    "Which of these essays would you recommend to a founder, and why?",
]


@dataclass(frozen=True)
class Turn:
    """One request of a work item.

    messages: the chat messages sent; for a follow-up, the messages added after the first turn and its
    answer (see :func:`turn_messages`). semkv: the request's ``semkv`` extension field."""

    messages: tuple[dict[str, str], ...]
    semkv: dict[str, Any]
    follow_up: bool = False


@dataclass(frozen=True)
class WorkItem:
    kind: str
    turns: tuple[Turn, ...]


def mix_counts(requests: int) -> dict[str, int]:
    """Requests of each kind for a load of ``requests`` requests (two-turn kinds get an even count)."""
    if requests < MIN_REQUESTS:
        raise ValueError(f"requests must be >= {MIN_REQUESTS} (one item of every kind), got {requests}")
    counts = {
        kind: TURNS[kind] * max(1, round(MIX[kind] * requests / TURNS[kind])) for kind in ("chat", "reworded")
    }
    counts["long"] = max(1, round(MIX["long"] * requests))
    counts["rag"] = requests - sum(counts.values())
    if counts["rag"] < 1:
        raise ValueError(f"requests={requests} leaves no RAG request")
    return {kind: counts[kind] for kind in MIX}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def build_mix(
    requests: int,
    seed: int,
    document_ids: list[str],
    passages: list[str],
    long_passages: list[str],
    docs_per_request: int,
    sparse: dict[str, Any],
) -> list[WorkItem]:
    """The load's work items in a seeded order. document_ids: uploaded documents (RAG); passages: texts
    pasted into chat and reworded prompts (item i uses passage i mod len); long_passages: texts of the
    long prompts; sparse: the long prompts' sparse settings (e.g. ``{"sparse": "quest", "kv_budget": 0.1}``)."""
    if not 1 <= docs_per_request <= len(document_ids):
        raise ValueError(f"docs_per_request must be in [1, {len(document_ids)}], got {docs_per_request}")
    if not passages or not long_passages:
        raise ValueError("passages and long_passages must not be empty")
    rng = random.Random(seed)
    counts = mix_counts(requests)
    items: list[WorkItem] = []
    for i in range(counts["rag"]):
        docs = rng.sample(document_ids, docs_per_request)
        semkv = {"documents": docs, "reuse": "auto"}
        items.append(WorkItem("rag", (Turn((user(RAG_QUESTIONS[i % len(RAG_QUESTIONS)]),), semkv),)))
    for i in range(counts["chat"] // 2):
        passage = passages[i % len(passages)]
        first = (user(f"{passage}\n\n{CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}"),)
        second = (user(FOLLOW_UPS[i % len(FOLLOW_UPS)]),)
        turns = (Turn(first, {"reuse": "auto"}), Turn(second, {"reuse": "auto"}, follow_up=True))
        items.append(WorkItem("chat", turns))
    for i in range(counts["reworded"] // 2):
        passage = passages[(i + counts["chat"] // 2) % len(passages)]
        original, reworded = REWORDINGS[i % len(REWORDINGS)]
        turns = tuple(
            Turn((user(f"{text}\n\n{passage}"),), {"reuse": "auto"}) for text in (original, reworded)
        )
        items.append(WorkItem("reworded", turns))
    for i in range(counts["long"]):
        text = f"{long_passages[i % len(long_passages)]}\n\n{LONG_QUESTIONS[i % len(LONG_QUESTIONS)]}"
        items.append(WorkItem("long", (Turn((user(text),), {"reuse": "auto", **sparse}),)))
    rng.shuffle(items)
    return items


def turn_messages(
    turn: Turn, previous: list[dict[str, str]] | None, previous_answer: str | None
) -> list[dict[str, str]]:
    """The messages a turn sends: a follow-up extends the previous turn's conversation with its answer."""
    if not turn.follow_up:
        return list(turn.messages)
    if previous is None or previous_answer is None:
        raise ValueError("a follow-up turn needs the previous turn's messages and answer")
    return [*previous, {"role": "assistant", "content": previous_answer}, *turn.messages]


def gaps(times: list[float]) -> list[float]:
    """Inter-token latencies: the gaps between consecutive streamed chunks (arrival times, seconds)."""
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def run_item(
    client: httpx.Client, model: str, item: WorkItem, index: int, max_tokens: int, cache_salt: str
) -> list[Outcome]:
    """One client's work on an item: its turns in order (a follow-up is sent after the answer it extends)."""
    outcomes: list[Outcome] = []
    previous: list[dict[str, str]] | None = None
    for t, turn in enumerate(item.turns):
        answer = outcomes[-1].text if outcomes else None
        messages = turn_messages(turn, previous, answer)
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "cache_salt": cache_salt,
            "semkv": turn.semkv,
        }
        outcomes.append(stream_chat(client, body, 100 * index + t))
        previous = messages
    return outcomes


def point_summary(outcomes: list[Outcome], kinds: list[str], wall_s: float) -> dict[str, Any]:
    """One sweep point of one mode: throughput, TTFT and inter-token latency percentiles (client side),
    and the reuse paths the server took, by request kind."""
    tokens = sum(int(o.stats.get("generated_tokens", 0)) for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes]
    itls = [g for o in outcomes for g in gaps(o.chunk_times)]
    paths = Counter(f"{k}:{o.stats.get('path', '?')}" for k, o in zip(kinds, outcomes, strict=True))
    return {
        "requests": len(outcomes),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": tokens / wall_s,
        "requests_per_s": len(outcomes) / wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(itls, 50),
        "itl_p99_ms": 1000 * percentile(itls, 99),
        "paths": " ".join(f"{p}x{n}" for p, n in sorted(paths.items())),
    }
