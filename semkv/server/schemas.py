"""Request bodies of the OpenAI-compatible API (validated with pydantic, strict types).

``cache_salt`` (a top-level field, as in vLLM) puts the request in its own cache namespace
within the caller's tenant: only requests with the same salt reuse each other's KV.

The ``semkv`` extension field (``extra_body={"semkv": {...}}`` in the ``openai``
client) carries what OpenAI has no field for::

    "semkv": {
        "documents": ["doc-..."],          # ids returned by POST /v1/documents
        "chunks": ["inline context", ...], # context chunks sent with the request
        "reuse": "auto", ...               # any other key: an option of Engine.generate
    }

Engine options are validated field by field (:mod:`semkv.server.options`) by building
the engine's own configs, so the set of accepted options grows with the engine (blend,
share, sparse settings) and a bad value is a 400 naming it, never a failure inside the
engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from semkv.request import MAX_NEW_TOKENS_LIMIT, MAX_STOP_CHARS
from semkv.sequence import MIN_TEMPERATURE

MAX_CONTEXT_ITEMS = 64
MAX_STOP = 4
MAX_SALT_CHARS = 256
SEED_RANGE = (-(2**63), 2**63 - 1)


def _unicode(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"); they are not text and tokenizers reject them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode ({exc.reason} at position {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1), AfterValidator(_unicode)]
StopStr = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_unicode)]


class _Strict(BaseModel):
    # Unknown fields are ignored (OpenAI clients add new ones over time); known ones are strictly typed.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class SemkvExtension(BaseModel):
    """Context by document id or inline, plus engine options (``model_extra``)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    documents: list[NonEmptyStr] = Field(default_factory=list, max_length=MAX_CONTEXT_ITEMS)
    chunks: list[Text] = Field(default_factory=list, max_length=MAX_CONTEXT_ITEMS)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: Text
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStr | list[StopStr] | None = Field(
        None, description=f"up to {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters each"
    )
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="not supported (0 only)")
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="not supported (0 only)")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported")
    user: Text | None = None
    cache_salt: Text | None = Field(
        None, max_length=MAX_SALT_CHARS, description="vLLM's per-request cache salt"
    )
    semkv: SemkvExtension | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature_scale(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.4g} (float32's smallest "
                "normal number; below it the logits cannot be scaled)"
            )
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_representable(cls, value: float | None) -> float | None:
        if value is not None and float(numpy.float32(value)) == 0.0:
            raise ValueError("top_p is 0 in float32 (the sampler's precision); it must be > 1.4e-45")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt``: one string or a list of strings (one choice each)."""

    prompt: Text | list[Text] = Field(..., description="a string or a list of strings")
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    echo: bool = Field(False, description="not supported")
    logprobs: int | None = Field(None, ge=0, le=0, description="not supported")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1")
    suffix: None = Field(None, description="not supported")

    @field_validator("prompt")
    @classmethod
    def _prompt_list(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not 1 <= len(value) <= 16:
            raise ValueError("prompt must be a string or a list of 1 to 16 strings")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def as_engine_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. The last message must be the user's."""

    messages: list[ChatMessage] = Field(..., min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    logprobs: bool | None = Field(None, description="not supported")

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if value[-1].role != "user":
            raise ValueError("the last message must have role 'user'")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class DocumentRequest(_Strict):
    """``POST /v1/documents``: each input string is one document, stored as one context chunk.

    shared: publish to every tenant (the API key needs the ``shared`` permission); else the documents
    belong to the caller's namespace (tenant + ``cache_salt``)."""

    input: NonEmptyStr | list[NonEmptyStr]
    shared: bool = False
    cache_salt: Text | None = Field(None, max_length=MAX_SALT_CHARS)

    @field_validator("input")
    @classmethod
    def _count(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not 1 <= len(value) <= MAX_CONTEXT_ITEMS:
            raise ValueError(f"input must be a string or a list of 1 to {MAX_CONTEXT_ITEMS} strings")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)
