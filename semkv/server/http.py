"""The HTTP server's side of slow clients: a connection must send its request headers within a timeout.

uvicorn times out an idle keep-alive connection, but not one that is sending its headers slowly
(slowloris): each byte resets nothing, and the connection is held until the client stops. The protocol
here is uvicorn's h11 protocol with a header timer: armed when a connection opens and again after each
response (the next request's headers), cancelled when a request's headers are complete; when it fires,
the connection is closed. The body's own timeout is the app's (``ServerConfig.body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request headers take longer than
    ``header_timeout_s`` (set on a subclass by :func:`header_timeout_protocol`)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers are complete: its cycle started
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is None or self.cycle.response_complete:  # no pipelined request started meanwhile
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.info("closing a connection whose request headers took over %.1f s", self.header_timeout_s)
            self.transport.close()


def header_timeout_protocol(seconds: float = DEFAULT_HEADER_TIMEOUT_S) -> type[HeaderTimeoutProtocol]:
    """The protocol class to give uvicorn (``uvicorn.run(app, http=...)``) for a header timeout of
    ``seconds``."""
    if not 0 < seconds <= 3600:
        raise ValueError(f"the header timeout must be in (0, 3600] seconds, got {seconds}")
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": float(seconds)})
