"""The engine thread: one thread loops ``engine.step()``; requests join and leave its batch between steps.

The event loop never runs model code, so a long prefill never stalls ``/health`` or the delivery of
other streams' tokens. A request is added with :meth:`EngineLoop.submit` (from the event loop): it gets
an asyncio queue that receives its :class:`~semkv.scheduler.StepOutput` s as the steps produce them,
the last one ``finished``. :meth:`EngineLoop.abort` frees a request at the next step (a client gone).
At most ``max_queue`` requests wait or run; one more is a 429 the client can retry.

The engine thread is the only thread that runs the model after start-up: other model work (precomputing
an uploaded document's KV) goes to it with :meth:`EngineLoop.run_job` and runs between steps. Torch's
OpenMP keeps a pool of worker threads per thread that ran a parallel region; once two such pools live on
a 2-core machine (the event loop's thread pool having run one prefill), every later parallel region
wakes its workers slowly and every decode step gets slower (see ``semkv serve``, which also builds the
engine on a thread that ends, for the same reason).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from semkv.request import GenerateRequest
from semkv.scheduler import QueueFull, StepOutput, StepStats
from semkv.server.errors import APIError

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle engine thread wakes this often to notice shutdown

T = TypeVar("T")


class EngineLoop:
    """The engine thread over an :class:`~semkv.engine.Engine`. ``submit`` / ``abort`` / ``pending`` are
    called from the event loop; ``on_step`` (if given) is called on the engine thread after every step
    that did work, with the step's stats, its outputs and the scheduler's running / waiting counts."""

    def __init__(
        self,
        engine: Any,
        max_queue: int = 64,
        on_step: Callable[[StepStats, list[StepOutput], int, int], None] | None = None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StepOutput]]] = {}
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="semkv-engine", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Requests submitted and not finished (waiting or running)."""
        with self._lock:
            return len(self._queues)

    def submit(
        self, request: GenerateRequest, request_id: str, timeout_s: float | None = None, waited_s: float = 0.0
    ) -> asyncio.Queue[StepOutput]:
        """Add ``request`` to the engine's scheduler; returns the queue of its outputs. A 429
        :class:`APIError` when ``max_queue`` requests are pending or the scheduler's queue is full."""
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        with self._lock:
            if len(self._queues) >= self.max_queue:
                raise APIError(
                    429,
                    f"the server queue is full ({self.max_queue} requests); retry later",
                    None,
                    "queue_full",
                )
            self._queues[request_id] = (asyncio.get_running_loop(), queue)  # before any step can answer
        try:
            self.engine.add_request(request, request_id=request_id, timeout_s=timeout_s, waited_s=waited_s)
        except QueueFull as exc:
            self._drop(request_id)
            raise APIError(429, f"{exc}", None, "queue_full") from exc
        except BaseException:
            self._drop(request_id)
            raise
        with self._wake:
            self._wake.notify()
        return queue

    def run_job(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` on the engine thread before its next step (model work other than requests, e.g. a
        document's KV); the future gets its result or its exception. Raises RuntimeError after shutdown."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopping:
                raise RuntimeError("the engine loop is shut down")
            self._jobs.append((job, future))
            self._wake.notify()
        return future

    def _run_jobs(self) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job, future in jobs:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # the caller gets it; the loop goes on
                future.set_exception(exc)

    def abort(self, request_id: str) -> None:
        """Free the request at the next step; its queue gets no more outputs."""
        if self._drop(request_id):
            self.engine.abort(request_id)

    def _drop(self, request_id: str) -> bool:
        with self._lock:
            return self._queues.pop(request_id, None) is not None

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._jobs and not self.engine.has_unfinished():
                    self._wake.wait(IDLE_WAIT_S)
                if self._stopping:
                    return
            self._run_jobs()
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a scheduler bug: answer every pending request, keep serving
                log.error("engine step failed: %s", exc, exc_info=exc)
                self._fail_all(exc)
                continue
            self._deliver(outputs)
            stats = self.engine.scheduler.last_step
            if self.on_step is not None and (stats.batch_size or stats.prefilled or outputs):
                scheduler = self.engine.scheduler
                self.on_step(stats, outputs, scheduler.num_running, scheduler.num_waiting)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            with self._lock:
                target = (
                    self._queues.pop(output.request_id, None)
                    if output.finished
                    else self._queues.get(output.request_id)
                )
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, output)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            ids = list(self._queues)
        for request_id in ids:
            self.engine.abort(request_id)
        self._deliver([StepOutput(i, finished=True, finish_reason="error", error=exc) for i in ids])

    def shutdown(self) -> None:
        """Stop the thread after its current step; pending requests are aborted."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=60)
        with self._lock:
            ids = list(self._queues)
            jobs, self._jobs = self._jobs, []
        for _, future in jobs:
            future.cancel()
        for request_id in ids:
            self.abort(request_id)
