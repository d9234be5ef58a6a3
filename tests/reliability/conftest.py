"""Reliability fixtures (helpers that are not fixtures live in ``reliability_helpers``)."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_hf_model


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random llama shared by a module's tests (a module may define its own)."""
    return tiny_hf_model("llama", len(tokenizer))
