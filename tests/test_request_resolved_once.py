"""A request is resolved once: its prompt tokenized once, its options resolved once, whatever route it takes.

Injected: counters on the tokenizer (every encode of the request's prompt text, on the engine's tokenizer or
any copy of it), on :func:`semkv.prompt.build_layout` as the engine calls it, and on
:meth:`EngineDefaults.reuse_options` / :meth:`EngineDefaults.resolve_sparse`. Must hold: one request through
``Engine.generate``, and one through the scheduler (``add_request`` + ``step``), each encodes its prompt
once and resolves its options once (the old engine laid out and resolved options at admission, at
``begin_prefill`` and in ``plan``: 2 layouts and 3 option resolutions per scheduled request). The
:class:`~semkv.request.ResolvedRequest` that admission built is what planning and prefill read.
"""

from __future__ import annotations

import pytest

import semkv.engine as engine_module
from semkv.profile import EngineDefaults
from semkv.request import GenerateRequest, ResolvedRequest

PROMPT = "The one prompt whose tokenizations are counted: a lighthouse keeper writes a letter."


class Counts:
    def __init__(self) -> None:
        self.encodes = 0
        self.layouts = 0
        self.options = 0
        self.sparse = 0


@pytest.fixture
def counts(monkeypatch, tokenizer) -> Counts:
    found = Counts()
    tokenizer_class = type(tokenizer)
    encode = tokenizer_class.__call__

    def counting_encode(self, text, *args, **kwargs):
        if text == PROMPT:
            found.encodes += 1
        return encode(self, text, *args, **kwargs)

    build_layout = engine_module.build_layout

    def counting_layout(*args, **kwargs):
        found.layouts += 1
        return build_layout(*args, **kwargs)

    reuse_options = EngineDefaults.reuse_options
    resolve_sparse = EngineDefaults.resolve_sparse

    def counting_options(self, request):
        found.options += 1
        return reuse_options(self, request)

    def counting_sparse(self, request, prompt_tokens):
        found.sparse += 1
        return resolve_sparse(self, request, prompt_tokens)

    monkeypatch.setattr(tokenizer_class, "__call__", counting_encode)
    monkeypatch.setattr(engine_module, "build_layout", counting_layout)
    monkeypatch.setattr(EngineDefaults, "reuse_options", counting_options)
    monkeypatch.setattr(EngineDefaults, "resolve_sparse", counting_sparse)
    return found


def test_generate_tokenizes_and_resolves_once(make_tiny_engine, counts):
    engine = make_tiny_engine("llama")
    generation = engine.generate(PROMPT, max_new_tokens=3, stop_at_eos=False)
    assert len(generation.token_ids) == 3
    assert (counts.encodes, counts.layouts, counts.options, counts.sparse) == (1, 1, 1, 1), vars(counts)


@pytest.mark.parametrize("reuse", ["auto", "prefix", "none"])
def test_a_scheduled_request_tokenizes_and_resolves_once(make_tiny_engine, counts, reuse):
    engine = make_tiny_engine("llama")
    request_id = engine.add_request(prompt=PROMPT, max_new_tokens=4, stop_at_eos=False, reuse=reuse)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    final = [o for o in outputs if o.request_id == request_id and o.finished]
    assert final and final[0].finish_reason == "length"
    assert (counts.encodes, counts.layouts, counts.options, counts.sparse) == (1, 1, 1, 1), vars(counts)


def test_the_resolved_request_is_what_the_steps_read(make_tiny_engine, counts):
    """Planning, admission and prefill take the resolved request as it is: nothing is resolved again."""
    engine = make_tiny_engine("llama")
    resolved = engine.resolve(GenerateRequest(prompt=PROMPT, max_new_tokens=2))
    assert isinstance(resolved, ResolvedRequest) and engine.resolve(resolved) is resolved
    admission = engine.admission(resolved)
    assert admission.prompt_tokens == resolved.prompt_tokens == len(resolved.layout)
    assert (
        admission.prefix_keys == resolved.prefix_keys
        and len(resolved.prefix_keys) == len(resolved.token_ids) // 4
    )
    engine.plan(resolved)
    seq = engine.prefill(resolved)
    assert seq.layout is resolved.layout and seq.options is resolved.options
    assert (counts.encodes, counts.layouts, counts.options, counts.sparse) == (1, 1, 1, 1), vars(counts)


def test_fit_context_lowers_max_new_tokens_to_the_room_left(make_tiny_engine):
    engine = make_tiny_engine("llama")
    request = GenerateRequest(prompt="word " * 2000, max_new_tokens=256)
    resolved = engine.resolve(request, fit_context=True)
    assert resolved.prompt_tokens + resolved.max_new_tokens == engine.max_context
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.resolve(GenerateRequest(prompt="word " * 2000, max_new_tokens=256))
