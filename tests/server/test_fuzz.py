"""Fuzz: hypothesis-generated request bodies (valid values mixed with junk of every JSON type, lone
surrogates, raw bytes) against every POST route of one running app. Injected: whatever hypothesis
builds. Must hold: no 5xx, every error in OpenAI's shape, every 200 a well-formed answer, and the
server still answers a good request afterwards. Derandomized, so a run is reproducible.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from semkv.request import REUSE_MODES, GenerateRequest
from semkv.server import ServerConfig

TINY = "tiny"
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)

any_text = st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=24
)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    any_text,
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
small_text = st.text(max_size=40)
# the attacks of issue 51: stop strings of 200K characters, text over any tiny model's character limit
long_stops = st.sampled_from(["s" * 200_000, ["ab" * 100_000] * 4, ["x" * 1000, "y" * 1001]])
huge_text = st.sampled_from(["w" * 400_000, "lorem ipsum " * 40_000])
word_text = st.text(min_size=1, max_size=40)


def maybe(valid: st.SearchStrategy, junk_in: int = 6) -> st.SearchStrategy:
    """``valid`` most of the time, junk one time in ``junk_in``."""
    return st.integers(1, junk_in).flatmap(lambda roll: junk if roll == 1 else valid)


tokens = maybe(st.one_of(st.integers(-3, 6), st.just(10**9)), 4)
option_names = sorted(
    {f.name for f in dataclasses.fields(GenerateRequest)}
    - {"prompt", "messages", "chunks", "max_new_tokens", "temperature", "top_p", "seed"}
)
semkv_field = maybe(
    st.fixed_dictionaries(
        {},
        optional={
            "documents": maybe(st.lists(st.text(max_size=40), max_size=2)),
            "chunks": maybe(st.lists(small_text, max_size=2)),
            "reuse": maybe(st.sampled_from([*REUSE_MODES, "bogus"])),
            **{name: junk for name in option_names if name != "reuse"},
            "not_an_option": junk,
        },
    )
)
common = {
    "model": maybe(st.just(TINY)),
    "temperature": maybe(st.floats(0, 2)),
    "top_p": maybe(st.floats(0, 1)),
    "n": maybe(st.integers(0, 2)),
    "stream": maybe(st.booleans()),
    "stop": maybe(st.one_of(small_text, st.lists(small_text, max_size=5), long_stops)),
    "seed": maybe(st.integers(-(2**64), 2**64)),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "semkv": semkv_field,
    "junk_field": junk,
}


def body(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    """A dict with every ``required`` key (sometimes overridden by a junk value of ``optional``)."""
    return st.tuples(st.fixed_dictionaries(required), st.fixed_dictionaries({}, optional=optional)).map(
        lambda parts: {**parts[0], **parts[1]}
    )


completion_body = body(
    {"model": st.just(TINY), "prompt": st.one_of(small_text, st.lists(small_text, max_size=3))},
    {
        **common,
        "prompt": maybe(st.one_of(small_text, any_text, st.lists(small_text, max_size=3), huge_text)),
        "max_tokens": tokens,
        "echo": junk,
        "logprobs": junk,
    },
)
message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["system", "user", "assistant", "developer"])),
        "content": maybe(
            st.one_of(
                small_text,
                any_text,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": small_text}), max_size=2),
                huge_text,
            )
        ),
    },
)
chat_body = body(
    {
        "model": st.just(TINY),
        "messages": maybe(
            st.one_of(
                st.lists(message, max_size=3).map(lambda m: [*m, {"role": "user", "content": "hi"}]),
                st.lists(message, max_size=3),
            )
        ),
    },
    {**common, "max_tokens": tokens, "max_completion_tokens": tokens},
)
document_body = st.fixed_dictionaries(
    {"input": maybe(st.one_of(word_text, st.lists(word_text, max_size=3), any_text, huge_text))},
    optional={"x": junk},
)


@pytest.fixture(scope="module")
def client(module_client_factory):
    """One app for every example of the module; short default generations keep the fuzz fast."""
    return module_client_factory(ServerConfig(completion_max_tokens=4, chat_max_tokens=4))


def check(client, route: str, response) -> None:
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, (route, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any("error" in json.loads(e) for e in events[:-1]), events
        return
    body = response.json()
    if route == "/v1/documents":
        assert body["data"] and all(d["id"].startswith("doc-") for d in body["data"])
    else:
        assert body["choices"] and "usage" in body


def post_json(client, route: str, body: dict) -> None:
    data = json.dumps(body).encode()  # ASCII-escaped: lone surrogates travel as "\udXXX"
    check(client, route, client.post(route, content=data, headers={"content-type": "application/json"}))


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(client, body):
    post_json(client, "/v1/completions", body)


@settings(FUZZ, max_examples=200)
@given(body=chat_body)
def test_fuzz_chat(client, body):
    post_json(client, "/v1/chat/completions", body)


@settings(FUZZ, max_examples=40)
@given(body=document_body)
def test_fuzz_documents(client, body):
    post_json(client, "/v1/documents", body)


@settings(FUZZ, max_examples=60)
@given(
    raw=st.binary(max_size=64),
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/documents"]),
)
def test_fuzz_raw_bytes(client, raw, route):
    check(client, route, client.post(route, content=raw, headers={"content-type": "application/json"}))


def test_still_serving_after_fuzz(client):
    """The same app that took every fuzzed request above still answers a good one."""
    r = client.post("/v1/completions", json={"model": TINY, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
