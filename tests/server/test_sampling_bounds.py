"""Sampling values at the edge of float32 at the API: nonsense is a 400 naming the field, the rest samples.

Injected: temperatures below float32's smallest normal number (1e-39, 5e-324) and a top_p that is 0 in
float32 (1e-46), each through completions and chat; the smallest admitted values (8e-38, the attack of
issue 51, and a top_p of 1e-44); ``semkv.stop``, which OpenAI's ``stop`` field sets. Must happen: the
first are 400s in OpenAI's shape with ``param`` naming the field; the admitted ones are 200s; ``semkv.stop``
is a 400 naming ``stop`` (it was a 500: the request was built with two ``stop`` arguments); the server
keeps serving.
"""

from __future__ import annotations

import pytest

from tests.server.test_bad_input import CHAT, GOOD, assert_openai_error


@pytest.fixture(scope="module")
def client(module_client_factory):
    return module_client_factory()


NONSENSE = [({"temperature": 1e-39}, "temperature"), ({"temperature": 5e-324}, "temperature")]
NONSENSE += [({"top_p": 1e-46}, "top_p")]


@pytest.mark.parametrize("base", [GOOD, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("fields,param", NONSENSE)
def test_unscalable_sampling_values_are_400(client, base, fields, param):
    path = "/v1/completions" if "prompt" in base else "/v1/chat/completions"
    error = assert_openai_error(client.post(path, json={**base, **fields}), 400, param=param)
    assert "float32" in error["message"]
    assert client.post(path, json=base).status_code == 200


@pytest.mark.parametrize("fields", [{"temperature": 8e-38}, {"temperature": 1.0, "top_p": 1e-44}])
def test_smallest_admitted_values_sample(client, fields):
    body = {**CHAT, **fields, "max_tokens": 8, "semkv": {"stop_at_eos": False}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def test_semkv_stop_is_a_400_naming_stop(client):
    r = client.post("/v1/completions", json={**GOOD, "semkv": {"stop": ["x"]}})
    error = assert_openai_error(r, 400, param="semkv.stop")
    assert "stop" in error["message"]
    assert client.post("/v1/completions", json={**GOOD, "stop": ["x"]}).status_code == 200
