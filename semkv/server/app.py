"""The OpenAI-compatible HTTP API over one :class:`~semkv.engine.Engine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as SSE
with ``"stream": true``), ``POST /v1/documents`` (+ ``GET``, ``GET /{id}``, ``DELETE /{id}``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Model work runs on the engine thread
(:class:`~semkv.server.worker.EngineLoop`), which loops the engine's scheduler: concurrent requests
are prefilled as they arrive and decode together, one batched forward per step. Each request receives
its step outputs through an asyncio queue; a streamed response sends their text as it comes; a client
that goes away (streaming or not) frees its sequence at the next step.

Security lives here, in the request-handling layer (not in the engine's worker):

* **Who.** With API keys (:mod:`semkv.server.auth`) every ``/v1`` route, ``/metrics`` and the OpenAPI
  pages (``/openapi.json``, ``/docs``, ``/redoc``) need ``Authorization: Bearer KEY`` (401 otherwise). The key's tenant and the request's ``cache_salt``
  are its namespace: every store key, the share index and the document registry are scoped by it.
* **What a response tells.** Stats that describe other requests' data (which path reused what, how
  many tokens an exact prefix or a shared prompt covered, why a path was refused, share references)
  are only returned with ``ServerConfig.debug_stats``; by default a response carries its own
  token counts and timings only, and how many of its prompt tokens came from the cache
  (``usage.prompt_tokens_details.cached_tokens``, ``semkv.reused_tokens``): reuse never crosses a
  namespace, so that count only tells a caller about its own namespace's requests.
* **Bounded before work.** A request's text is checked against the model's context in characters
  (:meth:`Engine.max_prompt_chars <semkv.engine.Engine.max_prompt_chars>`) before it is tokenized, and it
  is tokenized on a worker thread with a private tokenizer copy, without the engine's lock: a huge prompt
  is a 400 in milliseconds and never stalls the engine thread.
* **Limits.** The request body is limited by the bytes received (chunked bodies included) and by the
  time it takes to arrive (a 408; slow headers are the HTTP server's: :mod:`semkv.server.http`), every
  engine option is bounded (:mod:`semkv.server.options`), every request has a deadline (checked
  by the scheduler at every step: a 504, or an SSE error event once streaming), and a 500 never carries internal exception text.
* **Uploads.** ``POST /v1/documents`` computes one document per engine job (running streams decode
  between documents), stops when its client leaves or its deadline passes, counts against the tenant's
  document quota (count and tokens: a 429), and answers once the documents' KV is in every store tier.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from semkv import __version__ as semkv_version
from semkv.host_memory import give_back_freed_memory
from semkv.request import GenerateRequest, ResolvedRequest
from semkv.reuse.options import BlendConfig
from semkv.scheduler import DeadlineExceeded, StepOutput, StepStats
from semkv.server.auth import ANONYMOUS, APIKeys, Principal
from semkv.server.documents import Document, DocumentRegistry, document_id
from semkv.server.errors import APIError, SafeJSONResponse, error_body, install_error_handlers, internal_error
from semkv.server.metrics import ServerMetrics
from semkv.server.options import RESERVED_OPTIONS, check_engine_options, engine_option_names
from semkv.server.schemas import (
    MAX_SALT_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    DocumentRequest,
    SamplingFields,
    SemkvExtension,
)
from semkv.server.worker import EngineLoop
from semkv.store.keys import Namespace
from semkv.store.redis_tier import RedisTier

log = logging.getLogger(__name__)

# Stats a response carries without debug_stats: about the request's own tokens and time only.
PUBLIC_STATS = frozenset(
    {
        "prompt_tokens",
        "generated_tokens",
        "finish_reason",
        "ttft_s",
        "decode_s",
        "decode_ms_per_token",
        "server_ttft_s",
        "reused_tokens",  # the request's own prompt tokens served from its namespace's cache (a count)
        "sparse_policy",
        "sparse_steps",
        "kv_budget",
        "sparse_reselect_every",
    }
)
API_PAGES = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # need a key like /v1
PRINCIPAL = "semkv_principal"  # where the middleware leaves the caller in the ASGI scope's state
# A request body at least this large leaves transient copies (bytes, parsed text, validation) worth
# returning to the OS once it is answered (:func:`semkv.host_memory.give_back_freed_memory`).
TRIM_AFTER_BODY_BYTES = 4 * 1024**2
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/documents",
    "/v1/models",
    "/health",
    "/metrics",
)


@dataclass
class ServerConfig:
    """model_name: the id clients send as ``model`` (None: the engine's name).
    defaults: engine options applied to every request unless the request's ``semkv`` field overrides them.
    default_temperature: used when a request omits ``temperature`` (0 = greedy).
    completion_max_tokens / chat_max_tokens: used when a request omits ``max_tokens``
    (chat: also capped to what fits in the context).
    documents_dir: where document records are kept (None: ``<engine home>/documents``).
    api_keys: the keys and their tenants (None: one anonymous tenant, no authentication).
    debug_stats: return every engine stat in responses, also those describing other requests' data
        (which path reused how much, share references, refusal reasons). For trusted clients only.
    max_queue: requests waiting or running before a 429.
    request_timeout_s: each request's deadline from its arrival: a request not finished by then ends
        with a 504 "deadline_exceeded" (an SSE error event once streaming), checked at every step; a
        document upload is checked before each document and while it waits for the engine.
    max_documents_per_tenant / max_document_tokens_per_tenant: documents a tenant may have uploaded to
        this server (its namespaces and what it shared), by count and by tokens; an upload beyond them
        is a 429 "document_quota_exceeded" (None: no limit).
    body_timeout_s: a request body not received whole this long after its headers is a 408 (a slow
        client holds no connection for longer); the headers' own timeout is the HTTP server's
        (:func:`semkv.server.http.header_timeout_protocol`).
    """

    model_name: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    max_queue: int = 64
    default_temperature: float = 0.0
    completion_max_tokens: int = 16
    chat_max_tokens: int = 256
    max_body_bytes: int = 32 * 1024**2
    documents_dir: Path | None = None
    api_keys: APIKeys | None = None
    debug_stats: bool = False
    request_timeout_s: float = 300.0
    max_documents_per_tenant: int | None = 1024
    max_document_tokens_per_tenant: int | None = 4_000_000
    body_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_documents_per_tenant", "max_document_tokens_per_tenant"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
        if not 0 < self.body_timeout_s <= 3600:
            raise ValueError(f"body_timeout_s must be in (0, 3600], got {self.body_timeout_s}")
        if not 0 < self.request_timeout_s <= 86400:
            raise ValueError(f"request_timeout_s must be in (0, 86400], got {self.request_timeout_s}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError(f"default_temperature must be in [0, 2], got {self.default_temperature}")
        if self.completion_max_tokens < 1 or self.chat_max_tokens < 1:
            raise ValueError("default max tokens must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        bad = sorted(set(self.defaults) & set(RESERVED_OPTIONS))
        if bad:
            raise ValueError(f"server defaults cannot set {bad}: they come from each request's OpenAI fields")
        allowed = engine_option_names()
        unknown = sorted(set(self.defaults) - allowed)
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: {sorted(allowed)}")
        try:
            GenerateRequest(prompt="x", **self.defaults)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid server defaults: {exc}") from exc


def jsonable(value: Any) -> Any:
    """Stats -> JSON-safe values (tensors and other objects become strings)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return jsonable(value.item())
    return str(value)


@dataclass
class GenerationResult:
    """One finished generation as a response reports it.

    prompt_tokens: its prompt's tokens; cached_tokens: those whose KV came from its namespace's cache
    (the engine's ``reused_tokens``, within [0, prompt_tokens]). stats: every engine stat (what the
    ``semkv`` field shows of them depends on ``debug_stats``)."""

    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    finish_reason: str
    ttft_s: float | None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def of(cls, generation: Any, finish_reason: str, ttft_s: float | None) -> GenerationResult:
        stats = generation.stats
        prompt = int(stats.get("prompt_tokens", 0))
        cached = max(0, min(int(stats.get("reused_tokens", 0) or 0), prompt))
        return cls(generation.text, list(generation.token_ids), stats, finish_reason, ttft_s, prompt, cached)


class ServerState:
    """What the routes share: the engine, its thread, the document registry, metrics."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model_name = config.model_name or str(engine.name)
        self.created = int(time.time())
        self.loop = EngineLoop(engine, config.max_queue, self.observe_step)
        self.redis: RedisTier | None = engine.redis_tier()
        folder = config.documents_dir or Path(engine.home) / "documents"
        self.documents = DocumentRegistry(folder, self.redis, engine.store_secret)
        self.documents.load_all()
        self.uploading: dict[str, tuple[int, int]] = {}  # tenant -> (documents, tokens) being uploaded
        self.metrics = ServerMetrics(self.engine.store_for_metrics, self.failure_counts)

    def failure_counts(self) -> dict[str, int]:
        """Background work that failed without failing a request (for /metrics)."""
        return {**self.engine.failure_counts(), "document_records": self.documents.write_errors}

    # -- who is asking ----------------------------------------------------------------------------
    def principal(self, request: Request) -> Principal:
        """The caller the middleware authenticated (anonymous when the server has no API keys)."""
        found = (request.scope.get("state") or {}).get(PRINCIPAL)
        if isinstance(found, Principal):
            return found
        if self.config.api_keys is not None:  # never reached through the middleware; refuse anyway
            raise APIError(401, "missing or invalid API key", None, "invalid_api_key")
        return ANONYMOUS

    @staticmethod
    def namespace(principal: Principal, salt: str | None) -> Namespace:
        try:
            return Namespace(principal.tenant, salt or "")
        except ValueError as exc:
            raise APIError(400, f"cache_salt: {exc}", "cache_salt", "invalid_value") from None

    # -- validation -----------------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} is not served here; use {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def context_chunks(self, ext: SemkvExtension, namespace: Namespace) -> list[str]:
        chunks = []
        for doc_id in ext.documents:
            found = self.documents.resolve(doc_id, namespace)
            if found is None:
                raise APIError(
                    404, f"unknown document id {doc_id!r:.60}", "semkv.documents", "document_not_found"
                )
            chunks.append(found[0].text)
        return chunks + list(ext.chunks)

    def engine_request(
        self,
        body: SamplingFields,
        max_tokens: int | None,
        default_max: int,
        principal: Principal,
        **prompt: Any,
    ) -> GenerateRequest:
        """OpenAI fields + ``semkv`` extension -> the one validated :class:`GenerateRequest` of this
        generation (a 400 naming what is wrong). A ``max_tokens`` left to the server is ``default_max``,
        fitted to the context when the request is resolved (:meth:`prepare`)."""
        ext = body.semkv or SemkvExtension()
        options = ext.options
        check_engine_options(options)
        if isinstance(options.get("blend"), dict):  # how documents are made and stored stays the server's
            server = self.server_blend()
            options["blend"] = {
                **options["blend"],
                "sink": server.sink,
                "separator_in_chunk": server.separator_in_chunk,
            }
        namespace = self.namespace(principal, body.cache_salt)
        temperature = body.temperature if body.temperature is not None else self.config.default_temperature
        seed = (
            body.seed
            if body.seed is not None
            else (0 if temperature == 0 else int.from_bytes(os.urandom(8)) >> 2)
        )
        kwargs: dict[str, Any] = {
            **prompt,
            "chunks": self.context_chunks(ext, namespace),
            "max_new_tokens": max_tokens if max_tokens is not None else default_max,
            "temperature": float(temperature),
            "top_p": float(body.top_p if body.top_p is not None else 1.0),
            "seed": seed % 2**63,
            "stop": body.stop_list,
            **self.config.defaults,
            **options,
            "tenant": namespace.tenant,
            "cache_salt": namespace.salt or None,
        }
        try:
            return GenerateRequest(**kwargs)
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"invalid request: {exc}", "semkv", "invalid_value") from exc

    def prepare(
        self,
        body: SamplingFields,
        max_tokens: int | None,
        default_max: int,
        principal: Principal,
        **prompt: Any,
    ) -> ResolvedRequest:
        """The generation's request built (:meth:`engine_request`) and resolved by the engine: its text's
        length checked, tokenized on a private tokenizer copy, its options resolved. Blocking (documents
        are read, the prompt tokenized): call it off the event loop. Takes no engine lock."""
        request = self.engine_request(body, max_tokens, default_max, principal, **prompt)
        try:
            return self.engine.resolve(request, fit_context=max_tokens is None)
        except ValueError as exc:
            raise map_engine_error(exc) from exc

    def stats(self, results: list[GenerationResult]) -> dict[str, Any] | list[dict[str, Any]]:
        """The ``semkv`` field of a response: the engine's stats, all of them only with debug_stats."""
        out = []
        for r in results:
            stats = {**r.stats, "server_ttft_s": r.ttft_s}
            out.append(jsonable(stats if self.config.debug_stats else public_stats(stats)))
        return out[0] if len(out) == 1 else out

    def server_blend(self) -> BlendConfig:
        """The blend settings of a request that sets none: the server's defaults, else the engine's."""
        blend = GenerateRequest(prompt="x", **self.config.defaults).blend
        return blend if isinstance(blend, BlendConfig) else self.engine.defaults.blend

    # -- generations -----------------------------------------------------------------------------------
    def observe_step(self, stats: StepStats, outputs: list[StepOutput], running: int, waiting: int) -> None:
        """Step metrics (called on the engine thread after each step that did work)."""
        self.metrics.observe_step(stats, running, waiting)
        for output in outputs:
            if output.finished:
                self.metrics.ended.labels(str(output.finish_reason)).inc()

    def submit(self, request: ResolvedRequest, request_id: str, started: float) -> asyncio.Queue[StepOutput]:
        """Queue one resolved generation on the engine thread; returns the queue of its step outputs. Its
        deadline counts from ``started`` (the request's arrival): time spent reading and tokenizing it
        counts too, so a request already past it ends at the scheduler's next step (a 504) without
        running."""
        try:
            waited = time.perf_counter() - started
            return self.loop.submit(request, request_id, self.config.request_timeout_s, waited)
        except APIError:
            raise
        except Exception as exc:
            raise map_engine_error(exc) from exc

    async def collect(
        self, request_id: str, queue: asyncio.Queue[StepOutput], started: float, http: Request
    ) -> GenerationResult:
        """Wait for a generation's end (a non-streamed response); a client that disconnects meanwhile
        aborts it."""
        first: float | None = None
        checked = time.perf_counter()
        try:
            while True:
                output = await next_output(queue, http)
                if time.perf_counter() - checked > DISCONNECT_POLL_S:  # outputs come every step
                    checked = time.perf_counter()
                    if await http.is_disconnected():
                        raise ClientGone()
                if first is None and (output.token_ids or output.finished):
                    first = time.perf_counter()
                if output.finished:
                    return self.result(output, started, first)
        except (asyncio.CancelledError, ClientGone):
            self.loop.abort(request_id)
            raise

    def result(self, output: StepOutput, started: float, first: float | None) -> GenerationResult:
        """A finished output -> the result (metrics observed), or the error it ended with."""
        generation = output.generation
        if output.finish_reason in ("abort", "deadline", "error") or generation is None:
            raise map_engine_error(output.error or RuntimeError(f"request ended: {output.finish_reason}"))
        ttft = (first if first is not None else time.perf_counter()) - started
        self.metrics.observe_generation(generation.stats, len(generation.token_ids), ttft)
        finish = "length" if output.finish_reason == "length" else "stop"
        return GenerationResult.of(generation, finish, ttft)

    def check_document_chars(self, texts: list[str]) -> None:
        """A 400 naming the limit for a document whose text cannot fit in the model's context, known from
        its length in characters before it is tokenized (:attr:`Engine.max_prompt_chars
        <semkv.engine.Engine.max_prompt_chars>`)."""
        limit = self.engine.max_prompt_chars
        for i, text in enumerate(texts):
            if len(text) > limit:
                raise APIError(
                    400,
                    f"document {i} has {len(text)} characters; at most {limit} fit in the model's context "
                    f"of {self.engine.max_context} tokens",
                    "input",
                    "context_length_exceeded",
                )

    async def add_documents(
        self, texts: list[str], namespace: Namespace, owner: str, http: Request, started: float
    ) -> list[Document]:
        """Upload documents like a request: each document's KV is computed by its own job on the engine
        thread (decode steps of running requests go on between documents); before each one and while
        it waits, a client that left or a deadline (``request_timeout_s`` from ``started``) that passed
        ends the upload (nothing is registered; what is being computed finishes, nothing more starts).
        The tenant's quota (documents and tokens) is checked before any KV is computed. Answers once
        every document's KV is in every tier of the store (a server sharing the Redis tier reuses it
        from then on), then registers the records."""
        deadline = started + self.config.request_timeout_s
        # tokenized on a worker thread with a private tokenizer copy: no engine step waits for it
        counts = await run_in_threadpool(self.engine.count_tokens, texts)
        self.check_document_sizes(counts)
        new = [
            (t, n)
            for t, n in dict(zip(texts, counts, strict=True)).items()
            if not self.documents.known(document_id(t), namespace)
        ]
        with self.document_quota(owner, len(new), sum(n for _, n in new)):
            blend = self.server_blend()
            chunk_ids: list[str] = []
            for text in texts:  # chunks are precomputed the way the server's default blend looks them up
                keys = await self.engine_job(
                    lambda t=text: self.engine.add_chunks([t], blend, namespace), http, deadline
                )
                chunk_ids += [str(key) for key in keys]
            left = max(0.0, deadline - time.perf_counter())
            if not await run_in_threadpool(self.engine.wait_stored, chunk_ids, left):
                raise APIError(
                    504, "the documents' KV was not stored within the deadline", None, "deadline_exceeded"
                )
            shared = namespace == Namespace.shared()
            docs = [
                DocumentRegistry.new(t, n, [c], shared, owner)
                for t, n, c in zip(texts, counts, chunk_ids, strict=True)
            ]
            await run_in_threadpool(self.register, docs, namespace)
        self.metrics.document_tokens.inc(sum(counts))
        self.metrics.documents.inc(len(docs))
        return docs

    def check_document_sizes(self, counts: list[int]) -> None:
        for i, n in enumerate(counts):
            if n == 0:
                raise APIError(400, f"document {i} is empty after tokenization", "input", "invalid_value")
            if n >= self.engine.max_context:
                raise APIError(
                    400,
                    f"document {i} has {n} tokens; the model's context is {self.engine.max_context}",
                    "input",
                    "context_length_exceeded",
                )

    def register(self, docs: list[Document], namespace: Namespace) -> None:
        for doc in docs:
            self.documents.put(doc, namespace)

    @contextmanager
    def document_quota(self, owner: str, documents: int, tokens: int) -> Iterator[None]:
        """Hold ``documents`` / ``tokens`` of ``owner``'s quota while its upload runs; a 429 if they do not
        fit beside what it has and what its other uploads hold. Called on the event loop (no race)."""
        have, have_tokens = self.documents.usage(owner)
        held, held_tokens = self.uploading.get(owner, (0, 0))
        limits = (
            (self.config.max_documents_per_tenant, have + held + documents, "documents"),
            (
                self.config.max_document_tokens_per_tenant,
                have_tokens + held_tokens + tokens,
                "document tokens",
            ),
        )
        for limit, total, what in limits:
            if limit is not None and total > limit:
                raise APIError(
                    429,
                    f"this upload would bring the tenant to {total} {what}; its quota is {limit} (delete "
                    "documents to make room)",
                    "input",
                    "document_quota_exceeded",
                )
        self.uploading[owner] = (held + documents, held_tokens + tokens)
        try:
            yield
        finally:
            held, held_tokens = self.uploading.pop(owner, (0, 0))
            if held - documents > 0 or held_tokens - tokens > 0:
                self.uploading[owner] = (held - documents, held_tokens - tokens)

    async def engine_job(self, job: Callable[[], Any], http: Request, deadline: float) -> Any:
        """``job`` on the engine thread between steps; a client that leaves (:class:`ClientGone`) or a
        deadline that passes (504) while it waits cancels it if it has not started (one that has
        finishes on its own)."""
        if time.perf_counter() >= deadline:
            raise APIError(504, "the upload passed its deadline", None, "deadline_exceeded")
        if await http.is_disconnected():
            raise ClientGone()
        future = asyncio.wrap_future(self.loop.run_job(job))
        while True:
            done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await http.is_disconnected():
                future.cancel()
                raise ClientGone()
            if time.perf_counter() >= deadline:
                future.cancel()
                raise APIError(504, "the upload passed its deadline", None, "deadline_exceeded")
        try:
            return future.result()
        except APIError:
            raise
        except Exception as exc:
            raise map_engine_error(exc) from exc

    def delete_document(self, doc_id: str, namespace: Namespace) -> Document | None:
        """Remove a document's record and its chunk KV from every tier (on the engine thread, so no
        request holds the chunk meanwhile)."""
        doc = self.documents.delete(doc_id, namespace)
        if doc is not None:
            self.engine.delete_stored(list(doc.chunk_ids))
        return doc


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


async def next_output(queue: asyncio.Queue[StepOutput], http: Request) -> StepOutput:
    """The next step output; raises :class:`ClientGone` if the client disconnects while waiting."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await http.is_disconnected():
                raise ClientGone() from None


def map_engine_error(exc: BaseException) -> APIError:
    """An exception raised by a job -> the error answered to the client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, DeadlineExceeded):
        return APIError(504, str(exc), None, "deadline_exceeded")
    if isinstance(exc, ValueError):
        message = str(exc)
        code = "context_length_exceeded" if "context" in message else "invalid_value"
        return APIError(400, message, None, code)
    return internal_error(exc, "running a request on the engine")


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class GuardMiddleware:
    """Pure ASGI (streamed responses pass through untouched), in front of every route:

    * counts every HTTP request by endpoint and status;
    * authenticates ``/v1`` routes and ``/metrics`` when the server has API keys (401 without a
      valid key; 403 on ``/metrics`` for a key without the ``metrics`` permission) and leaves the
      caller in the scope's state;
    * reads the whole request body and refuses it with a 413 as soon as more bytes arrived than
      the limit allows, whatever ``Content-Length`` said (or with chunked transfer, none), or with a 408
      when it has not arrived whole within ``body_timeout_s``; the app then receives the body it read;
    * after a request whose body had :data:`TRIM_AFTER_BODY_BYTES` or more, gives the memory its copies
      used back to the OS (on a worker thread), so a burst of huge bodies leaves the resident set where
      it was.
    """

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = next((e for e in ENDPOINTS if path == e or path.startswith(e + "/")), "other")
        status = 500
        start = time.perf_counter()

        async def send_counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        received = 0
        try:
            refusal = self._authenticate(scope, path)
            if refusal is None:
                refusal, receive, received = await self._read_body(scope, receive)
            if refusal is not None:
                await refusal(scope, receive, send_counted)
                return
            await self.app(scope, receive, send_counted)
        finally:
            if received >= TRIM_AFTER_BODY_BYTES:
                del receive  # the replayed body
                await run_in_threadpool(give_back_freed_memory)
            metrics = self.state.metrics
            metrics.requests.labels(endpoint, str(status)).inc()
            metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    def _authenticate(self, scope: dict, path: str) -> Response | None:
        """Leave the caller in ``scope["state"]``; a 401 / 403 response when it may not go on."""
        keys = self.state.config.api_keys
        guarded = path.startswith("/v1/") or path in ("/v1", "/metrics", *API_PAGES)
        principal: Principal | None = ANONYMOUS
        if keys is not None and guarded:
            headers = dict(scope.get("headers") or [])
            raw = headers.get(b"authorization")
            principal = keys.authenticate(raw.decode("latin-1") if raw is not None else None)
            if principal is None:
                return SafeJSONResponse(
                    error_body(
                        401,
                        "missing or invalid API key: send it as 'Authorization: Bearer KEY'",
                        None,
                        "invalid_api_key",
                    ),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            if path == "/metrics" and not principal.can_read_metrics:
                return SafeJSONResponse(
                    error_body(403, "this API key may not read /metrics", None, "permission_denied"),
                    status_code=403,
                )
        scope.setdefault("state", {})[PRINCIPAL] = principal
        return None

    async def _read_body(self, scope: dict, receive: Callable) -> tuple[Response | None, Callable, int]:
        """(413 response or None, a receive that replays the body read, the bytes read)."""
        limit = self.state.config.max_body_bytes
        too_large = SafeJSONResponse(
            error_body(413, f"request body over {limit} bytes", None, "too_large"), status_code=413
        )
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return too_large, receive, 0
        parts: list[bytes] = []
        size = 0
        deadline = time.perf_counter() + self.state.config.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                timeout = self.state.config.body_timeout_s
                body = error_body(408, f"request body not received within {timeout:g} s", None, "timeout")
                return SafeJSONResponse(body, status_code=408, headers={"Connection": "close"}), receive, size
            if message["type"] != "http.request":  # the client went away: let the app see it
                return None, _replay(b"".join(parts), receive, first=message), size
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large, receive, size
            parts.append(chunk)
            if not message.get("more_body", False):
                return None, _replay(b"".join(parts), receive), size


def _replay(body: bytes, receive: Callable, first: dict | None = None) -> Callable:
    """A receive callable that hands over ``body`` once (or ``first``), then defers to ``receive``."""
    pending: list[dict] = [first or {"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:
        if pending:
            return pending.pop()
        return await receive()

    return replay


def create_app(engine: Any, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`~semkv.engine.Engine`)."""
    state = ServerState(engine, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.loop.shutdown()

    app = FastAPI(
        lifespan=lifespan,
        title="semkv",
        version=semkv_version,
        description="OpenAI-compatible server with semantic KV-cache reuse",
    )
    app.state.semkv = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if state.config.api_keys is not None:  # unauthenticated: nothing about other tenants' activity
            return {"status": "ok", "model": state.model_name}
        redis = "disabled" if state.redis is None else state.redis.health  # up, degraded or down
        return {
            "status": "ok",
            "model": state.model_name,
            "queue": state.loop.pending,
            "running": state.engine.scheduler.num_running,
            "waiting": state.engine.scheduler.num_waiting,
            "redis": redis,
            "documents": len(state.documents),
        }

    @app.get("/metrics")
    def metrics() -> Response:
        state.metrics.queue_depth.set(state.loop.pending)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "semkv"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card()

    @app.post("/v1/documents")
    async def add_documents(body: DocumentRequest, request: Request) -> dict[str, Any]:
        started = time.perf_counter()
        principal = state.principal(request)
        if body.shared and not principal.can_publish:
            raise APIError(
                403, "this API key may not publish shared documents", "shared", "permission_denied"
            )
        namespace = Namespace.shared() if body.shared else state.namespace(principal, body.cache_salt)
        state.check_document_chars(body.texts)
        docs = await state.add_documents(body.texts, namespace, principal.tenant, request, started)
        return {"object": "list", "data": [d.summary() for d in docs]}

    @app.get("/v1/documents")
    def list_documents(
        request: Request, cache_salt: str | None = None, limit: str = "20", after: str | None = None
    ) -> dict[str, Any]:
        """The caller's documents, then the shared ones, oldest first, a page of ``limit`` (1..100) after
        the document ``after`` (OpenAI's list shape: ``first_id``, ``last_id``, ``has_more``).
        Sync: reads disk / Redis off the event loop."""
        namespace = state.namespace(state.principal(request), _salt(cache_salt))
        mine = state.documents.list(namespace)
        shared = [] if namespace == Namespace.shared() else state.documents.list(Namespace.shared())
        return _page([d.summary() for d in mine + shared], _limit(limit), after)

    @app.get("/v1/documents/{doc_id}")
    def get_document(doc_id: str, request: Request, cache_salt: str | None = None) -> dict[str, Any]:
        namespace = state.namespace(state.principal(request), _salt(cache_salt))
        found = state.documents.resolve(doc_id, namespace)
        if found is None:
            raise APIError(404, f"unknown document id {doc_id!r:.60}", "doc_id", "document_not_found")
        return {**found[0].summary(), "text": found[0].text}

    @app.delete("/v1/documents/{doc_id}")
    async def delete_document(doc_id: str, request: Request, cache_salt: str | None = None) -> dict[str, Any]:
        """Delete one of the caller's documents (or a shared one it published, with the ``shared``
        permission): the record and its chunk KV. 404 for anything else, whoever owns it."""
        principal = state.principal(request)
        namespace = state.namespace(principal, _salt(cache_salt))
        if state.documents.get(doc_id, namespace) is None:
            shared = state.documents.get(doc_id, Namespace.shared())
            if shared is None or not principal.can_publish or shared.owner != principal.tenant:
                raise APIError(404, f"unknown document id {doc_id!r:.60}", "doc_id", "document_not_found")
            namespace = Namespace.shared()
        deleted = await _run(state, lambda: state.delete_document(doc_id, namespace))
        if deleted is None:
            raise APIError(404, f"unknown document id {doc_id!r:.60}", "doc_id", "document_not_found")
        return {"id": doc_id, "object": "document", "deleted": True}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        started = time.perf_counter()
        state.check_model(body.model)
        principal = state.principal(request)
        prompts = body.prompts
        if body.stream and len(prompts) != 1:
            raise APIError(400, "streaming supports a single prompt", "prompt", "invalid_value")
        default = state.config.completion_max_tokens
        calls = [
            await run_in_threadpool(state.prepare, body, body.max_tokens, default, principal, prompt=p)
            for p in prompts
        ]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
        if body.stream:

            def chunk(delta: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
                return {**base, "choices": [choice], **extra}

            return await _stream(state, body, calls[0], started, request, rid, chunk, None)

        ids = [f"{rid}-{i}" for i in range(len(calls))]
        queues = []
        try:
            for call, request_id in zip(calls, ids, strict=True):  # all queued at once: they decode together
                queues.append(state.submit(call, request_id, started))
            results = [await state.collect(i, q, started, request) for i, q in zip(ids, queues, strict=True)]
        finally:
            for request_id in ids:  # a failed or abandoned request frees the others (no-op once finished)
                state.loop.abort(request_id)
        choices = [
            {"index": i, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
            for i, r in enumerate(results)
        ]
        return {**base, "choices": choices, "usage": _usage(results), "semkv": state.stats(results)}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        started = time.perf_counter()
        state.check_model(body.model)
        messages = [m.as_engine_message() for m in body.messages]
        principal = state.principal(request)
        default = state.config.chat_max_tokens
        call = await run_in_threadpool(
            state.prepare, body, body.token_limit, default, principal, messages=messages
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
        if body.stream:

            def chunk(delta: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
                content = {} if delta is None else {"content": delta}
                return {**base, "choices": [{"index": 0, "delta": content, "finish_reason": finish}], **extra}

            opening = {
                **base,
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ],
            }
            return await _stream(state, body, call, started, request, rid, chunk, opening)

        queue = state.submit(call, rid, started)
        result = await state.collect(rid, queue, started, request)
        message = {"role": "assistant", "content": result.text}
        return {
            **base,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": result.finish_reason}],
            "usage": _usage([result]),
            "semkv": state.stats([result]),
        }

    return app


async def _run(state: ServerState, job: Callable[[], Any]) -> Any:
    """A blocking job that uses the model, on the engine thread between steps (off the event loop)."""
    try:
        return await asyncio.wrap_future(state.loop.run_job(job))
    except APIError:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise map_engine_error(exc) from exc


def _usage(results: list[GenerationResult]) -> dict[str, Any]:
    """OpenAI's ``usage``: token counts, and ``prompt_tokens_details.cached_tokens``: the prompt tokens
    whose KV came from the request's own namespace's cache (prefix blocks, stored chunks, a shared
    prompt) instead of a full computation."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


MAX_PAGE = 100


def _limit(value: str) -> int:
    """A list's ``limit`` query parameter: an integer in 1..MAX_PAGE (a 400 otherwise)."""
    if not value.isdigit() or not 1 <= int(value) <= MAX_PAGE:
        raise APIError(400, f"limit must be an integer in 1..{MAX_PAGE}, got {value[:20]!r}", "limit")
    return int(value)


def _page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's list page: ``limit`` items after the one whose id is ``after`` (a 400 if none is)."""
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after: no document {after[:60]!r} in this list", "after", "invalid_value")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }


def _salt(value: str | None) -> str | None:
    """A ``cache_salt`` query parameter, checked like the body field."""
    if value is not None and len(value) > MAX_SALT_CHARS:
        raise APIError(400, f"cache_salt must be at most {MAX_SALT_CHARS} characters", "cache_salt")
    return value


def public_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The stats a response may carry without debug_stats: the request's own counts and timings."""
    return {name: value for name, value in stats.items() if name in PUBLIC_STATS}


async def _stream(
    state: ServerState,
    body: SamplingFields,
    call: ResolvedRequest,
    started: float,
    request: Request,
    request_id: str,
    chunk: Callable[..., dict[str, Any]],
    opening: dict[str, Any] | None,
) -> Any:
    """Start the generation; answer a JSON error if it fails before its first output, else an SSE stream
    of its text as the engine's steps produce it. A client that goes away aborts the generation."""
    queue = state.submit(call, request_id, started)
    try:
        first = await next_output(queue, request)
    except (asyncio.CancelledError, ClientGone):
        state.loop.abort(request_id)
        raise
    first_at = time.perf_counter()
    if first.finished and first.finish_reason in ("abort", "deadline", "error"):
        raise map_engine_error(first.error or RuntimeError(f"request ended: {first.finish_reason}"))

    async def sse() -> AsyncIterator[bytes]:
        output = first
        try:
            if opening is not None:
                yield _sse(opening)
            while True:
                if output.text:
                    yield _sse(chunk(output.text))
                if output.finished:
                    try:
                        result = state.result(output, started, first_at)
                    except APIError as exc:
                        yield _sse(exc.body())
                    else:
                        yield _sse(chunk(None, result.finish_reason, semkv=state.stats([result])))
                        if body.include_usage:
                            yield _sse({**chunk(None), "choices": [], "usage": _usage([result])})
                    yield _sse("[DONE]")
                    return
                output = await queue.get()
        finally:
            state.loop.abort(request_id)  # client gone mid-stream: free the sequence (no-op once finished)

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
