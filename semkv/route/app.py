"""``semkv route``: one OpenAI-compatible endpoint in front of several ``semkv serve`` backends.

Every ``/v1/...`` request is passed through unchanged (method, path, query, body, headers — the
``Authorization`` header included, untouched) to the backend chosen by
:class:`~semkv.route.pool.BackendPool`, and the answer comes back unchanged: a JSON answer as a whole,
an SSE stream (``"stream": true``) chunk by chunk as the backend sends it. Two headers are added to
the answer: ``x-semkv-backend`` (who served it) and ``x-semkv-route`` (why: affinity, balanced,
least_loaded, retry).

A backend that refuses the connection is marked down and the request goes to the next candidate; one
that drops the connection before answering is retried on the next candidate too (a generation or a
document upload can be repeated: uploads are content-addressed). A background task polls every
backend's ``/health``. The router's own routes: ``GET /health`` (its backends; 503 when none is up)
and ``GET /metrics`` (Prometheus: requests per backend and reason, upstream errors, backends up, load).
The router knows nothing of the server's internals: it reads request bodies only to find the
affinity key (see :mod:`semkv.route.ring`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from semkv.route.pool import Backend, BackendPool
from semkv.route.ring import affinity_key

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones httpx / the ASGI server set themselves.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass
class RouterConfig:
    """backends: base URLs of ``semkv serve`` processes (``http://host:port``).
    prefix_chars: leading characters of a prompt hashed for affinity (about the first blocks' text).
    max_imbalance: in-flight requests a backend may have beyond the least-loaded one, counting the request
        being routed, before its keys spill over (1: the least-loaded, preferring the key's owner; 0: least-loaded).
    health_interval_s / health_timeout_s: how often and how patiently ``/health`` is polled.
    connect_timeout_s: a backend that does not accept a connection within it is skipped.
    read_timeout_s: longest wait for a backend's next bytes (None: no limit).
    """

    backends: list[str]
    prefix_chars: int = 256
    max_imbalance: int = 1
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float | None = 600.0
    max_body_bytes: int = 64 * 1024**2
    vnodes: int = 256

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("backends: give at least one backend URL")
        cleaned = []
        for url in self.backends:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"backends: {url!r} is not a base URL like http://127.0.0.1:8000")
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"backends: duplicate URL in {self.backends}")
        self.backends = cleaned
        if self.prefix_chars < 1:
            raise ValueError(f"prefix_chars must be >= 1, got {self.prefix_chars}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {self.max_imbalance}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.read_timeout_s is not None and self.read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be positive or None, got {self.read_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


def error_response(status: int, message: str, code: str) -> JSONResponse:
    """An error in OpenAI's shape, like the backends answer."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


class PoolCollector:
    """Backends up and in flight, read from the pool at scrape time."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("semkv_route_backend_up", "1 if the backend is healthy", labels=["backend"])
        load = GaugeMetricFamily(
            "semkv_route_in_flight", "requests in flight through this router", labels=["backend"]
        )
        for b in self.pool.backends:
            up.add_metric([b.url], 1.0 if b.up else 0.0)
            load.add_metric([b.url], float(b.in_flight))
        yield up
        yield load


class RouterMetrics:
    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter(
            "semkv_route_requests", "requests sent to a backend, by why", ["backend", "reason"], registry=r
        )
        self.upstream_errors = Counter(
            "semkv_route_upstream_errors", "failed attempts on a backend", ["backend", "kind"], registry=r
        )
        self.responses = Counter("semkv_route_responses", "answers by status", ["status"], registry=r)
        self.latency = Histogram("semkv_route_request_seconds", "time to the answer's headers", registry=r)
        r.register(PoolCollector(pool))


class RouterState:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = BackendPool(config.backends, config.vnodes, config.max_imbalance)
        self.metrics = RouterMetrics(self.pool)
        self.client: httpx.AsyncClient | None = None

    def http(self) -> httpx.AsyncClient:
        assert self.client is not None, "the router's HTTP client starts with the app"
        return self.client

    async def check(self, backend: Backend) -> None:
        try:
            response = await self.http().get(f"{backend.url}/health", timeout=self.config.health_timeout_s)
            ok, error = response.status_code == 200, f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        self.pool.mark(backend, ok, None if ok else error)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.pool.backends))

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_all()


def forwarded_headers(headers: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in HOP_HEADERS]


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None when it is over ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def proxy(request: Request) -> Response:
    state: RouterState = request.app.state.router
    body = await read_body(request, state.config.max_body_bytes)
    if body is None:
        return error_response(413, f"request body over {state.config.max_body_bytes} bytes", "too_large")
    path = request.url.path
    key = affinity_key(request.method, path, body, state.config.prefix_chars)
    raw_path = request.scope.get("raw_path") or path.encode()
    query = request.scope.get("query_string", b"")
    target = raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
    candidates, reason = state.pool.candidates(key)
    headers = forwarded_headers(request.headers)
    started = time.perf_counter()
    last_error = "no backend"
    for attempt, backend in enumerate(candidates):
        why = reason if attempt == 0 else "retry"
        upstream = state.http().build_request(
            request.method, backend.url + target, content=body, headers=headers
        )
        backend.in_flight += 1
        backend.routed += 1
        state.metrics.routed.labels(backend.url, why).inc()
        released = False
        try:
            response = await state.http().send(upstream, stream=True)
            extra = {"x-semkv-backend": backend.url, "x-semkv-route": why}
            out_headers = [(k, v) for k, v in response.headers.items() if k.lower() not in HOP_HEADERS]
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                state.metrics.latency.observe(time.perf_counter() - started)
                state.metrics.responses.labels(str(response.status_code)).inc()
                released = True  # the stream releases the backend when it ends
                return StreamingResponse(
                    relay(state, backend, response),
                    status_code=response.status_code,
                    headers={**dict(out_headers), **extra},
                )
            try:
                content = await response.aread()
            finally:
                await response.aclose()
        except httpx.TimeoutException as exc:
            if not isinstance(exc, httpx.ConnectTimeout):  # the backend is slow, not gone: don't repeat
                state.metrics.upstream_errors.labels(backend.url, "timeout").inc()
                state.metrics.responses.labels("504").inc()
                return error_response(504, f"backend {backend.url} timed out: {exc}", "backend_timeout")
            state.pool.mark(backend, False, f"connect timeout: {exc}")
            state.metrics.upstream_errors.labels(backend.url, "connect").inc()
            last_error = f"{backend.url}: {type(exc).__name__}: {exc}"
            continue
        except httpx.ConnectError as exc:
            state.pool.mark(backend, False, f"{type(exc).__name__}: {exc}")
            state.metrics.upstream_errors.labels(backend.url, "connect").inc()
            last_error = f"{backend.url}: {type(exc).__name__}: {exc}"
            continue
        except httpx.TransportError as exc:  # dropped before a whole answer: repeat on the next backend
            state.metrics.upstream_errors.labels(backend.url, "dropped").inc()
            last_error = f"{backend.url}: {type(exc).__name__}: {exc}"
            log.warning("backend %s dropped a request (%s); trying the next one", backend.url, last_error)
            continue
        finally:
            if not released:
                backend.in_flight -= 1
        state.metrics.latency.observe(time.perf_counter() - started)
        state.metrics.responses.labels(str(response.status_code)).inc()
        encoded = response.headers.get("content-encoding") is not None  # aread() decoded it
        plain = [(k, v) for k, v in out_headers if not (encoded and k.lower() == "content-encoding")]
        return Response(content, status_code=response.status_code, headers={**dict(plain), **extra})
    status = 503 if not candidates else 502
    state.metrics.responses.labels(str(status)).inc()
    return error_response(status, f"no backend could serve the request (last: {last_error})", "no_backend")


async def relay(state: RouterState, backend: Backend, response: httpx.Response) -> AsyncIterator[bytes]:
    """The backend's stream, chunk by chunk; a stream cut by the backend ends with an SSE error event."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        state.metrics.upstream_errors.labels(backend.url, "stream_cut").inc()
        log.warning("backend %s cut a stream: %s", backend.url, exc)
        error = {"error": {"message": f"backend stream cut: {exc}", "type": "server_error", "param": None}}
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        backend.in_flight -= 1
        await response.aclose()


async def health(request: Request) -> JSONResponse:
    state: RouterState = request.app.state.router
    live = state.pool.live()
    body = {
        "status": "ok" if live else "unavailable",
        "backends_up": len(live),
        "backends": [b.summary() for b in state.pool.backends],
    }
    return JSONResponse(body, status_code=200 if live else 503)


async def metrics(request: Request) -> Response:
    state: RouterState = request.app.state.router
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def not_found(request: Request, exc: Exception) -> JSONResponse:
    return error_response(
        404, f"{request.url.path} is not a route of this router (it passes /v1/...)", "not_found"
    )


def create_router_app(config: RouterConfig) -> Starlette:
    """The router's ASGI app; its HTTP client and health checks start and stop with the app."""
    state = RouterState(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        # Idle connections expire before a backend's own keep-alive timeout (uvicorn: 5 s), so the router
        # does not reuse a connection the backend is closing, which would fail the request there and
        # retry it on another backend, losing its affinity.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            state.client = client
            await state.check_all()  # first picture of the backends before the first request
            checker = asyncio.create_task(state.health_loop())
            try:
                yield
            finally:
                checker.cancel()
                state.client = None

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/{path:path}", proxy, methods=METHODS),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found})
    app.state.router = state
    return app
