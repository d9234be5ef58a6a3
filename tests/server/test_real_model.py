"""The server over the real SmolLM2, called with the official ``openai`` client (few tokens)."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig, create_app

pytestmark = pytest.mark.real_model

DOC = "Ilse Varga is the head librarian of the Tromso public library. She catalogued 9,412 maps in 2019."
QUESTION = "Who is the head librarian of the Tromso public library?"


def test_openai_client_against_smollm2(make_smol_engine):
    """A factual chat answer; a document uploaded once then blended, answering like full prefill."""
    engine = make_smol_engine()
    with TestClient(create_app(engine, ServerConfig(debug_stats=True))) as http:
        oai = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        model = oai.models.list().data[0].id
        answer = oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
        )
        assert "Paris" in answer.choices[0].message.content
        doc = http.post("/v1/documents", json={"input": DOC}).json()["data"][0]
        runs = {}
        for reuse in ("none", "blend"):
            runs[reuse] = oai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=6,
                extra_body={"semkv": {"documents": [doc["id"]], "reuse": reuse, "store_prompt": False}},
            )
        full, blended = runs["none"], runs["blend"]
        assert "Ilse Varga" in full.choices[0].message.content
        assert blended.model_extra["semkv"]["path"] == "blend"
        assert blended.model_extra["semkv"]["reused_tokens"] >= 0.8 * doc["tokens"]  # 15% recomputed
        # Whether the blended answer equals the full one is a quality question for `semkv bench blend`:
        # with the default BOS chunk sink at ratio 0.15 this one-document case answers "The head
        # librarian of the T..." (first-token KL 0.21); the template sink reproduces full prefill here.
        assert blended.choices[0].message.content.strip()
