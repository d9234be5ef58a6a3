"""``GET /v1/documents`` pages like OpenAI's lists: ``limit`` (1..100, default 20) and ``after`` (a document
id), with ``first_id``, ``last_id`` and ``has_more``.

Injected: 25 documents uploaded by the anonymous tenant, listed by pages of 10 and with the default;
bad ``limit`` and ``after`` values. Must happen: the pages are disjoint and together the whole list in
order; ``has_more`` is false on the last one; the default page has 20; a limit outside 1..100 or an
unknown ``after`` is a 400 in OpenAI's shape naming the parameter. On the old code the list had no paging.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.server.test_bad_input import assert_openai_error

COUNT = 25


@pytest.fixture(scope="module")
def client(module_client_factory) -> TestClient:
    c = module_client_factory()
    texts = [f"Note {i}: the tide turned at {i % 12} o'clock." for i in range(COUNT)]
    assert c.post("/v1/documents", json={"input": texts}).status_code == 200
    return c


def test_pages_cover_the_list_in_order(client):
    ids, after, pages = [], None, 0
    while True:
        params = {"limit": 10, **({"after": after} if after else {})}
        page = client.get("/v1/documents", params=params).json()
        pages += 1
        assert page["object"] == "list" and len(page["data"]) <= 10
        ids += [d["id"] for d in page["data"]]
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == 3 and len(ids) == len(set(ids)) == COUNT
    whole = client.get("/v1/documents", params={"limit": 100}).json()
    assert [d["id"] for d in whole["data"]] == ids and whole["has_more"] is False
    default = client.get("/v1/documents").json()
    assert len(default["data"]) == 20 and default["has_more"] is True


@pytest.mark.parametrize(
    "params,param",
    [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"after": "doc-" + "0" * 32}, "after"),
    ],
)
def test_bad_paging_is_a_400(client, params, param):
    assert_openai_error(client.get("/v1/documents", params=params), 400, param=param)
