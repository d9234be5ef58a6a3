"""A huge prompt is refused before any work, and never holds up another tenant.

Injected (the attack of issue 51 against a live uvicorn server with two tenants): a 30 MB prompt from
tenant alice, then four of them at once while tenant bob asks a small question; a 30 MB chat message, a
30 MB inline chunk and a document over the context; stop strings of 200K characters.

Must hold: each huge request is a 400 ``context_length_exceeded`` in OpenAI's error shape naming the
limit in characters, answered within 0.5 s (median of three, after a first one that pays the process's first allocations
of a 30 MB body: 0.5-1.1 s on an AMD EPYC runner; the old server tokenized all of it under the engine's lock
first: 32-37 s on SmolLM2) without touching the engine: no engine step runs, the engine's lock is never
taken, the text is never tokenized (no encode of a text over the limit); bob's request completes with a
200 while the four arrive; a stop string over the limit is a 400 naming it.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from semkv.request import MAX_STOP_CHARS
from semkv.server import ServerConfig
from semkv.server.auth import APIKeys

TINY = "tiny"
KEYS = {"alice": "sk-alice-0123456789abcdef", "bob": "sk-bob-0123456789abcdef"}
HUGE_CHARS = 30 * 1024**2
REFUSE_WITHIN_S = 0.5  # the target for a 30 MB prompt (median of the timed refusals)
TIMED_REFUSALS = 3


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"}


class Watch:
    """Counts what a refused request must not cause: engine steps, takes of the engine's lock, encodes of
    a text over the limit."""

    def __init__(self) -> None:
        self.steps = 0
        self.locks = 0
        self.long_encodes = 0


class CountingLock:
    """The engine's re-entrant lock, counting every acquisition."""

    def __init__(self, lock, watch: Watch) -> None:
        self._lock, self._watch = lock, watch

    def __enter__(self):
        self._watch.locks += 1
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


@pytest.fixture
def server(live_server, tiny_app, monkeypatch, tokenizer):
    """(base URL, engine, watch) of a live server with API keys for alice and bob."""
    keys = APIKeys.parse("\n".join(f"{key} {tenant}" for tenant, key in KEYS.items()))
    app = tiny_app(ServerConfig(api_keys=keys, max_body_bytes=64 * 1024**2))
    engine = app.state.semkv.engine
    watch = Watch()
    step = engine.step

    def counting_step():
        watch.steps += 1
        return step()

    encode = type(tokenizer).__call__
    limit = engine.max_prompt_chars

    def counting_encode(self, text, *args, **kwargs):
        if isinstance(text, str) and len(text) > limit:
            watch.long_encodes += 1
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(engine, "step", counting_step)
    monkeypatch.setattr(engine, "_lock", CountingLock(engine._lock, watch))
    monkeypatch.setattr(type(tokenizer), "__call__", counting_encode)
    url = live_server(app=app)
    return url, engine, watch


def huge_chat() -> bytes:
    text = ("lorem ipsum dolor sit amet " * (HUGE_CHARS // 27 + 1))[:HUGE_CHARS]
    body = {"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return json.dumps(body).encode()


def small_chat(client: httpx.Client, url: str) -> httpx.Response:
    body = {"model": TINY, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 4}
    return client.post(f"{url}/v1/chat/completions", json=body, headers=auth("bob"))


def assert_context_error(response: httpx.Response, limit: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    assert str(limit) in error["message"] and "characters" in error["message"], error


def test_a_30mb_prompt_is_refused_at_once_without_touching_the_engine(server):
    url, engine, watch = server
    body = huge_chat()
    with httpx.Client(timeout=60) as client:
        assert small_chat(client, url).status_code == 200  # the engine has started and served
        time.sleep(0.2)  # the engine thread goes idle
        steps, locks = watch.steps, watch.locks
        took = []
        for _ in range(1 + TIMED_REFUSALS):  # the first one pays the process's first 30 MB allocations
            start = time.perf_counter()
            r = client.post(f"{url}/v1/chat/completions", content=body, headers=auth("alice"))
            took.append(time.perf_counter() - start)
            assert_context_error(r, engine.max_prompt_chars)
        assert statistics.median(took[1:]) <= REFUSE_WITHIN_S, f"refused in {took} s"
        assert (watch.steps - steps, watch.locks - locks, watch.long_encodes) == (0, 0, 0), vars(watch)
        assert small_chat(client, url).status_code == 200


def test_four_huge_prompts_do_not_hold_up_another_tenant(server):
    url, engine, watch = server
    body = huge_chat()
    statuses: list[int] = []
    with httpx.Client(timeout=60) as client:

        def attack() -> None:
            r = client.post(f"{url}/v1/chat/completions", content=body, headers=auth("alice"))
            statuses.append(r.status_code)

        attackers = [threading.Thread(target=attack) for _ in range(4)]
        for thread in attackers:
            thread.start()
        innocent = small_chat(client, url)
        for thread in attackers:
            thread.join()
    assert innocent.status_code == 200 and innocent.json()["choices"][0]["message"]["content"] is not None
    assert statuses == [400] * 4 and watch.long_encodes == 0


def test_huge_chunk_document_and_completion_are_refused(server):
    url, engine, watch = server
    limit = engine.max_prompt_chars
    over = "x" * (limit + 1)
    with httpx.Client(timeout=60) as client:
        chunk = {"model": TINY, "prompt": "Summarise.", "max_tokens": 2, "semkv": {"chunks": [over]}}
        assert_context_error(client.post(f"{url}/v1/completions", json=chunk, headers=auth("alice")), limit)
        split = {
            "model": TINY,
            "prompt": "y" * (limit // 2 + 1),
            "semkv": {"chunks": ["z" * (limit // 2 + 1)]},
        }
        assert_context_error(client.post(f"{url}/v1/completions", json=split, headers=auth("alice")), limit)
        document = client.post(f"{url}/v1/documents", json={"input": [over]}, headers=auth("alice"))
        assert_context_error(document, limit)
        assert client.get(f"{url}/v1/documents", headers=auth("alice")).json()["data"] == []
    assert watch.long_encodes == 0


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stop_strings_over_the_limit_are_a_400(server, route):
    url, _, _ = server
    prompt = (
        {"prompt": "Hello"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    with httpx.Client(timeout=60) as client:
        for stop in (["s" * 200_000] * 4, "s" * (MAX_STOP_CHARS + 1)):
            r = client.post(
                f"{url}{route}",
                json={"model": TINY, **prompt, "max_tokens": 2, "stop": stop},
                headers=auth("alice"),
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] is not None and error["param"].startswith("stop"), error
            assert str(MAX_STOP_CHARS) in error["message"], error
        fits = client.post(
            f"{url}{route}",
            json={"model": TINY, **prompt, "max_tokens": 2, "stop": ["s" * MAX_STOP_CHARS] * 4},
            headers=auth("alice"),
        )
        assert fits.status_code == 200, fits.text
        reserved = client.post(
            f"{url}{route}", json={"model": TINY, **prompt, "semkv": {"stop": ["x"]}}, headers=auth("alice")
        )
        assert reserved.status_code == 400 and reserved.json()["error"]["param"] == "semkv.stop", (
            reserved.text
        )
