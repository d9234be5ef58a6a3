"""Engine options a request may set through its ``semkv`` field, checked one by one.

Every option is validated before the request is queued, by building the engine's own config
objects field by field, so a bad value is a 400 whose ``param`` names it (``semkv.share.simhash.
tables``), never a failure (or an allocation) inside the engine. The configs bound every number a
client can send (:mod:`semkv.validation`). What a request must not choose is refused here:

* options OpenAI has a field for (``max_tokens``, ``temperature``, ...) and the namespace (``tenant``
  comes from the API key, ``cache_salt`` is its own top-level field);
* ``blend.sink``: chunks of documents are precomputed with the server's sink, and a request naming
  another one would replace the stored chunk entries every other request of its namespace uses;
* ``blend.separator_in_chunk``: documents are stored with (or without) the separator after each chunk as
  the server's default says, and a request asking the other way would find none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from semkv.request import GenerateRequest
from semkv.reuse.lsh import SimHashConfig
from semkv.reuse.options import BlendConfig, ShareConfig
from semkv.server.errors import APIError

# Engine options a request sets through other fields, not through "semkv" (-> where to set them).
RESERVED_OPTIONS = {
    "prompt": "prompt / messages",
    "messages": "messages",
    "chunks": "semkv.chunks / semkv.documents",
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "tenant": "the API key (Authorization: Bearer ...)",
    "cache_salt": "cache_salt (a top-level field)",
    "stop": "stop (a top-level field)",
}
SERVER_ONLY = {
    ("blend", "sink"): "the server's --default blend=... (documents are precomputed with it)",
    ("blend", "separator_in_chunk"): "the server's --default blend=... (documents are stored with it)",
}


def engine_option_names() -> set[str]:
    """Options a request may set through ``semkv``: the GenerateRequest fields OpenAI has no field for."""
    return {f.name for f in dataclasses.fields(GenerateRequest)} - set(RESERVED_OPTIONS)


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param, "invalid_value")


def _check_config(cls: type, value: Any, param: str, nested: dict[str, type] | None = None) -> None:
    """``value`` must be a JSON object whose every field builds ``cls`` on its own, then as a whole."""
    nested = nested or {}
    if not isinstance(value, dict):
        raise _invalid(param, f"must be an object of {cls.__name__} fields, got {type(value).__name__}")
    known = _fields(cls)
    for name, field_value in value.items():
        where = f"{param}.{name}"
        if name not in known:
            raise APIError(400, f"unknown option {where!r}; known: {sorted(known)}", where, "unknown_option")
        key = (param.rsplit(".", 1)[-1], name)
        if key in SERVER_ONLY:
            raise APIError(400, f"{where} is not settable per request; it is {SERVER_ONLY[key]}", where)
        if name in nested:
            _check_config(nested[name], field_value, where)
            continue
        try:
            cls(**{name: field_value})
        except (TypeError, ValueError) as exc:
            raise _invalid(where, str(exc)) from None
    try:
        cls(**value)
    except (TypeError, ValueError) as exc:
        raise _invalid(param, str(exc)) from None


def check_engine_options(options: dict[str, Any]) -> None:
    """Raise a 400 :class:`APIError` naming the first option a request may not set or sets badly."""
    allowed = engine_option_names()
    for name, value in options.items():
        param = f"semkv.{name}"
        if name in RESERVED_OPTIONS:
            raise APIError(400, f"set {name!r} with {RESERVED_OPTIONS[name]}", param)
        if name not in allowed:
            raise APIError(
                400,
                f"unknown semkv option {name!r}; known: {sorted(allowed | {'documents', 'chunks'})}",
                param,
                "unknown_option",
            )
        if name in ("share", "blend") and value is None:
            continue  # the engine's default
        if name == "share":
            _check_config(ShareConfig, value, param, {"simhash": SimHashConfig})
        elif name == "blend":
            _check_config(BlendConfig, value, param)
        else:
            try:
                GenerateRequest(prompt="x", **{name: value})
            except (TypeError, ValueError) as exc:
                raise _invalid(param, str(exc)) from None
