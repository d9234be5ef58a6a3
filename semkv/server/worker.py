"""The engine's queue: every job that touches the model runs on one dedicated thread, in arrival order.

The event loop never runs model code, so a long prefill never stalls other clients'
streams or ``/health``; the queue is bounded, and a full queue is a 429 the client can
retry, not unbounded memory growth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from semkv.server.errors import APIError

T = TypeVar("T")


class EngineWorker:
    """One engine thread, FIFO, at most ``max_queue`` jobs waiting or running. Used from the event loop only."""

    def __init__(self, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.pending = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semkv-engine")

    def submit(self, job: Callable[[], T]) -> asyncio.Future[T]:
        """Queue ``job``; raises a 429 :class:`APIError` when the queue is full."""
        if self.pending >= self.max_queue:
            raise APIError(
                429, f"the server queue is full ({self.max_queue} requests); retry later", None, "queue_full"
            )
        self.pending += 1
        future = asyncio.wrap_future(self._executor.submit(job))
        future.add_done_callback(self._done)
        return future

    def _done(self, _: asyncio.Future) -> None:
        self.pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
