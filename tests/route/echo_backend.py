"""A small real HTTP backend for router tests (uvicorn in a thread): it answers what it received, so a
test can see exactly what the router passed through.

Routes: ``GET /health``; ``* /v1/echo``: method, path, query, headers (as a list of pairs) and body
(latin-1) as JSON, plus an ``x-echo`` response header; ``GET /v1/status/{code}``: that status with an
OpenAI-shaped error body; ``POST /v1/slow-stream``: three SSE events ``interval_s`` apart, then
``[DONE]``; ``POST /v1/completions``: ``{"served_by": name}`` (any body).
"""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from semkv.processes import free_port


class EchoBackend:
    def __init__(self, name: str, interval_s: float = 0.4) -> None:
        self.name = name
        self.interval_s = interval_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests = 0
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def app(self) -> Starlette:
        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ok", "name": self.name})

        async def echo(request: Request) -> JSONResponse:
            self.requests += 1
            body = await request.body()
            return JSONResponse(
                {
                    "method": request.method,
                    "path": request.url.path,
                    "query": request.url.query,
                    "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.headers.raw],
                    "body": body.decode("latin-1"),
                    "served_by": self.name,
                },
                headers={"x-echo": self.name},
            )

        async def status(request: Request) -> JSONResponse:
            code = int(request.path_params["code"])
            error = {"message": f"status {code}", "type": "invalid_request_error", "param": None, "code": "x"}
            return JSONResponse({"error": error}, status_code=code)

        async def slow_stream(request: Request) -> StreamingResponse:
            async def events():
                for i in range(3):
                    yield f'data: {{"i": {i}, "sent": {time.time()}}}\n\n'.encode()
                    await asyncio.sleep(self.interval_s)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def completions(request: Request) -> JSONResponse:
            self.requests += 1
            await request.body()
            return JSONResponse({"served_by": self.name})

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
        return Starlette(
            routes=[
                Route("/health", health),
                Route("/v1/echo", echo, methods=methods),
                Route("/v1/status/{code}", status),
                Route("/v1/slow-stream", slow_stream, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
            ]
        )

    def start(self) -> None:
        config = uvicorn.Config(self.app(), host="127.0.0.1", port=self.port, log_level="error")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, f"echo backend {self.name} did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._server = None
