"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server answers — a validation error, malformed JSON, an unknown
route, a prompt over the context, an engine failure — goes through here, so a
client always gets JSON it can parse, and the status tells whose fault it was.
A 500 never carries the exception's text (it may name files, keys or other
requests' data): the client gets an error id, the server log has the details.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error answered to the client with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def internal_error(exc: BaseException, what: str) -> APIError:
    """A 500 for an unexpected exception: logged with a fresh error id, answered with the id only."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s while %s: %s: %s", error_id, what, type(exc).__name__, exc, exc_info=exc)
    return APIError(
        500, f"internal server error (error id {error_id}; see the server log)", None, "internal_error"
    )


class SafeJSONResponse(JSONResponse):
    """ASCII-escaped JSON: an error may quote client input, which can hold lone surrogates."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return SafeJSONResponse(error_body(status, message, param, code), status_code=status)


# Union members pydantic names in error locations ("prompt.list[str].0"); not part of the parameter's path.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "constrained-str"}


def _loc_param(loc: tuple[Any, ...]) -> str | None:
    parts = [
        str(p)
        for p in loc
        if p != "body" and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p))
    ]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg')}", None, "invalid_json"
    param = _loc_param(tuple(first.get("loc", ())))
    messages = [f"{_loc_param(tuple(e.get('loc', ()))) or 'body'}: {e.get('msg')}" for e in errors[:5]]
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(messages) + more, param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return SafeJSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_message(exc)
        return error_response(400, message, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), None, code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        error = internal_error(exc, f"serving {request.method} {request.url.path}")
        return SafeJSONResponse(error.body(), status_code=500)
