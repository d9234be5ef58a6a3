"""Continuous batching: requests join and leave the running batch between steps (nano-vllm / vLLM v1 shape).

:class:`Scheduler` holds the waiting queue and the running batch. Each :meth:`Scheduler.step`:

1. takes in the requests added and the aborts asked since the last step (both thread-safe: a server
   adds and aborts from its event loop while the engine thread steps), and ends requests past their
   deadline;
2. gives back KV memory no live sequence uses (:meth:`StepRunner.reclaim_kv`), continues the prefills
   in progress, then admits waiting requests in arrival order while the limits allow (running
   sequences, tokens computed in the step, live-KV bytes: see below) and starts theirs. A step
   computes at most ``max_batched_tokens`` tokens (one per decoding sequence + prompt tokens): a long
   full prefill goes in chunks over several steps, so running streams wait at most one chunk; while
   a request that could start and finish in half of the budget waits, the prefills in progress take
   at most the other half, so a short arrival starts during a long prefill rather than after it; a
   prefill that completes gives its request's first token in this step. While a prefill is in
   progress, a prompt that does not fit in what is left of the step waits for it to finish instead of
   slowing it (a burst of long prompts is prefilled one after another, so the first of them gets its
   first token early); a prompt's cost is what it computes: its tokens less the stored exact prefix
   it will load (:meth:`StepRunner.cached_prompt_tokens`);
3. decodes every sequence that was running before this step by one token, in one batched forward,
   and gives back the KV memory of the sequences that finished;
4. returns a :class:`StepOutput` for each request that produced text or finished.

The model work goes through a :class:`StepRunner` (the engine: ``Engine.begin_prefill`` /
``advance_prefill`` / ``complete_prefill`` / ``decode_batch`` / ``store_prefill`` / ``finish``); the
scheduler only decides what runs when, so its logic is tested without a model.

Live KV (``max_live_kv_bytes``) is the memory the runner really holds for live sequences
(:meth:`StepRunner.live_kv_bytes`: for the engine, its decode arena with free slots and padding, plus the
caches outside it), not a sum of per-request reservations. A waiting request is admitted when that plus
what starting it adds (:meth:`StepRunner.kv_bytes_to_admit`: nothing if its cache starts in a free arena
slot, its own cache otherwise) stays within the limit; the runner keeps later growth (the arena's, when
the request's cache joins it) within the limit itself. A request admitted but not started is counted once,
by what it will add. When nothing else is live the head request is admitted if it fits the limit alone
(memory held outside the scheduler is not waited for: no deadlock), and ended with a clear error if not.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

from semkv.config import SchedulerConfig
from semkv.request import AnyRequest, GenerateRequest, Generation, ResolvedRequest
from semkv.sequence import TokenCallback
from semkv.text_stream import TextStream

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """``add_request`` when ``max_waiting`` requests are already waiting."""


class DeadlineExceeded(TimeoutError):
    """A request passed its deadline (``add_request(timeout_s=...)``) before it finished."""


class RunningSequence(Protocol):
    """What the scheduler reads of a prefilled sequence (:class:`semkv.sequence.Sequence`)."""

    @property
    def finished(self) -> bool: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def failure(self) -> BaseException | None:
        """What ended this sequence alone in a batched decode step (None while it is fine)."""
        ...

    def emit_pending(self, on_token: TokenCallback | None) -> None:
        """Hand the tokens not yet emitted to ``on_token``; a callback returning False stops the sequence."""
        ...


class PrefillWork(Protocol):
    """What the scheduler reads of a prefill in progress (:class:`semkv.sequence.PrefillJob`)."""

    @property
    def done(self) -> bool: ...

    @property
    def remaining(self) -> int: ...

    @property
    def chunkable(self) -> bool: ...


S = TypeVar("S", bound=RunningSequence)
J = TypeVar("J", bound=PrefillWork)


@dataclass(frozen=True)
class Admission:
    """What admitting a request costs: its prompt tokens, the rows of its live cache (prompt +
    max_new_tokens) and their bytes.

    prefix_keys: the chained keys of the prompt's full blocks of ``prefix_block_size`` tokens in its
    cache namespace, for :meth:`StepRunner.cached_prompt_tokens`; empty when it reuses no prefix."""

    prompt_tokens: int
    kv_bytes: int
    kv_rows: int
    prefix_keys: tuple[str, ...] = ()
    prefix_block_size: int = 0


class StepRunner(Protocol[S, J]):
    """The model work a scheduler drives (implemented by :class:`semkv.engine.Engine`)."""

    def admission(self, request: AnyRequest) -> Admission:
        """The request's cost; a ValueError if it can never run (empty, too long)."""
        ...

    def cached_prompt_tokens(self, admission: Admission) -> int:
        """Leading prompt tokens the request would load rather than compute if it started now."""
        ...

    def begin_prefill(self, request: AnyRequest) -> J:
        """Plan the request and make its cache (nothing computed yet)."""
        ...

    def advance_prefill(self, job: J, max_tokens: int | None = None) -> int:
        """Compute up to ``max_tokens`` more prompt tokens (a job that is not chunkable: all of them);
        returns the tokens computed."""
        ...

    def complete_prefill(self, job: J) -> S:
        """The prefilled job as a sequence with its first token sampled."""
        ...

    def store_prefill(self, seq: S) -> float:
        """Keep what the prefill made reusable (after the first token is out)."""
        ...

    def decode_batch(self, seqs: list[S]) -> object:
        """Decode every sequence by one token, in one batched forward."""
        ...

    def finish(self, seq: S) -> Generation:
        """The sequence's result (also for one ended early)."""
        ...

    def text_stream(self, request: AnyRequest) -> TextStream:
        """A detokenizer with the request's stop strings."""
        ...

    def live_kv_bytes(self) -> int:
        """KV memory held now for live sequences and prefills."""
        ...

    def kv_bytes_to_admit(self, admissions: list[Admission]) -> int:
        """How much :meth:`live_kv_bytes` grows when these requests start, in this order."""
        ...

    def reclaim_kv(self) -> None:
        """Give back KV memory no live sequence uses."""
        ...


@dataclass
class StepOutput:
    """What one step produced for one request.

    token_ids / text: tokens kept and text safe to show, new in this step (a final EOS is not kept;
        text is held back while it may be the start of a stop string or an incomplete character).
    finished: the request is over; ``finish_reason`` says why: "length", "eos", "stop" (a stop string),
        "abort", "deadline" or "error". ``generation``: the result, for a request that started (text
        cut at a stop string). ``error``: the exception, for "deadline" and "error".
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    generation: Generation | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class StepStats:
    """One step: sequences decoded together, requests prefilled, prompt tokens prefilled, seconds."""

    batch_size: int = 0
    prefilled: int = 0
    prefill_tokens: int = 0
    step_s: float = 0.0
    prefilling: int = 0  # prefills still in progress after the step
    live_kv_bytes: int = 0  # KV memory held after the step (StepRunner.live_kv_bytes)


@dataclass(eq=False)
class _Entry(Generic[S, J]):
    """A request in the scheduler: waiting (no job), prefilling (a job), running (a sequence)."""

    request_id: str
    request: AnyRequest
    deadline: float | None
    timeout_s: float | None
    admission: Admission | None = None
    job: J | None = None
    seq: S | None = None
    stream: TextStream | None = None
    cost: tuple[int, int] | None = None  # (prefills stored by then, its cost): see Scheduler._cost


class Scheduler(Generic[S, J]):
    """Waiting queue + running batch over a :class:`StepRunner`. ``step`` runs on one thread at a time;
    ``add_request``, ``abort`` and the counters may be called from any thread."""

    def __init__(
        self,
        runner: StepRunner[S, J],
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.waiting: deque[_Entry[S, J]] = deque()
        self.prefilling: list[_Entry[S, J]] = []
        self.running: list[_Entry[S, J]] = []
        self.last_step = StepStats()
        self._inbox: list[_Entry[S, J]] = []
        self._aborts: list[str] = []
        self._live_ids: set[str] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stored = 0  # prefills stored so far: a waiting request's cost is re-estimated after each

    # -- from any thread ---------------------------------------------------------------------------
    def add_request(
        self,
        request: AnyRequest,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
        waited_s: float = 0.0,
    ) -> str:
        """Queue ``request`` (as given, or resolved by the runner ahead: the scheduler hands it back to the
        runner as it is); returns its id (``request_id`` if given: it must not be in use). It is
        admitted at a later step. ``timeout_s``: its deadline, in seconds from its arrival, which was
        ``waited_s`` seconds ago (e.g. a server's time to read and tokenize it); past it, it ends with
        :class:`DeadlineExceeded`. Raises :class:`QueueFull` when ``max_waiting`` requests wait."""
        if not isinstance(request, (GenerateRequest, ResolvedRequest)):
            raise ValueError(f"request must be a GenerateRequest, got {type(request).__name__}")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        with self._lock:
            if len(self._inbox) + len(self.waiting) >= self.config.max_waiting:
                raise QueueFull(f"{self.config.max_waiting} requests are already waiting; retry later")
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._live_ids:
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self._live_ids:
                raise ValueError(f"request_id {request_id!r} is already in use")
            deadline = None if timeout_s is None else self.clock() + timeout_s - max(0.0, waited_s)
            self._inbox.append(_Entry(request_id, request, deadline, timeout_s))
            self._live_ids.add(request_id)
            return request_id

    def abort(self, request_id: str) -> bool:
        """Ask to end ``request_id``; it is freed at the next step (an output with reason "abort").
        False if no such request is waiting or running."""
        with self._lock:
            if request_id not in self._live_ids:
                return False
            self._aborts.append(request_id)
            return True

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._inbox) + len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences decoding, and prefills in progress."""
        return len(self.running) + len(self.prefilling)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live_ids)

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Prefill work within the step's token budget, then one batched decode; see the module docstring."""
        start = self.clock()
        outputs: list[StepOutput] = []
        self._take_inbox(outputs)
        self._expire(outputs)
        self.runner.reclaim_kv()
        decoding = list(self.running)  # decoded in this step; prefills completing now start the next one
        budget = self.config.max_batched_tokens - len(decoding)
        computed, completed = 0, 0
        share = self._prefill_share(budget)
        for entry in list(self.prefilling):
            done, tokens = self._advance(entry, share - computed, computed, outputs)
            computed, completed = computed + tokens, completed + done
        for entry in self._admit(outputs, budget - computed, computed):
            if self._begin(entry, outputs):
                done, tokens = self._advance(entry, budget - computed, computed, outputs)
                computed, completed = computed + tokens, completed + done
        batch = [e for e in decoding if e in self.running]
        if batch:
            self._decode(batch, outputs)
        self.runner.reclaim_kv()  # what the sequences that left held
        self.last_step = StepStats(
            len(batch),
            completed,
            computed,
            self.clock() - start,
            len(self.prefilling),
            self.runner.live_kv_bytes(),
        )
        return outputs

    def _prefill_share(self, budget: int) -> int:
        """Tokens the prefills in progress may compute in this step: the whole budget, or half of it
        while a waiting request could start and finish its prefill in the other half (a free place in
        the batch, room for its live KV), so a short request arriving during a long chunked prefill gets
        its first token in the next step instead of after the whole prompt (the long prefill still
        advances by at least half a budget every step: arrivals never starve it). A longer prompt does
        not start while a prefill is in progress (:meth:`_admit`): it takes nothing from it."""
        half = max(1, budget // 2)
        if self.waiting and self.prefilling and self.num_running < self.config.max_running:
            for entry in self.waiting:
                need = self._admission(entry)
                if need is None:
                    return half  # it can never run: _admit ends it
                if self._cost(entry) <= budget - half:
                    return half if self._fits_kv_now(need) else budget
        return budget

    def _fits_kv_now(self, need: Admission) -> bool:
        """Whether a request's live KV fits beside what is held (admission goes in arrival order: if it
        does not fit, no request is admitted in this step)."""
        if self.config.max_live_kv_bytes is None:
            return True
        return self._kv_fits(self.runner.live_kv_bytes(), [need])

    def _admission(self, entry: _Entry[S, J]) -> Admission | None:
        """The entry's admission (asked of the runner once); None if the request can never run."""
        if entry.admission is None:
            try:
                entry.admission = self.runner.admission(entry.request)
            except ValueError:
                return None
        return entry.admission

    def _cost(self, entry: _Entry[S, J]) -> int:
        """Prompt tokens a request computes if it starts now: its prompt less the stored exact prefix it
        would load (a blend's or share's recompute counts whole: known only once planned). The store is
        asked once, then again only after a prefill of this scheduler was stored (a waiting request is
        looked at in every step; a prefix stored or evicted otherwise is seen then). Its admission must
        be known."""
        if entry.cost is None or entry.cost[0] != self._stored:
            assert entry.admission is not None
            need = entry.admission
            entry.cost = (self._stored, max(1, need.prompt_tokens - self.runner.cached_prompt_tokens(need)))
        return entry.cost[1]

    def _kv_fits(self, held: int, admissions: list[Admission]) -> bool:
        """Whether ``held`` bytes plus what starting ``admissions`` adds stays within max_live_kv_bytes."""
        limit = self.config.max_live_kv_bytes
        return limit is None or held + self.runner.kv_bytes_to_admit(admissions) <= limit

    def _take_inbox(self, outputs: list[StepOutput]) -> None:
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            entry = self._find(request_id)
            if entry is not None:
                self._end(entry, "abort", outputs)

    def _find(self, request_id: str) -> _Entry[S, J] | None:
        for entry in itertools.chain(self.waiting, self.prefilling, self.running):
            if entry.request_id == request_id:
                return entry
        return None

    def _expire(self, outputs: list[StepOutput]) -> None:
        now = self.clock()
        entries = itertools.chain(self.waiting, self.prefilling, self.running)
        for entry in [e for e in entries if e.deadline is not None]:
            if entry.deadline is not None and now >= entry.deadline:
                where = (
                    "while decoding"
                    if entry.seq is not None
                    else "while prefilling"
                    if entry.job
                    else "while waiting"
                )
                error = DeadlineExceeded(
                    f"request {entry.request_id} passed its deadline of {entry.timeout_s:g} s {where}"
                )
                self._end(entry, "deadline", outputs, error)

    def _admit(self, outputs: list[StepOutput], budget: int, computed: int) -> list[_Entry[S, J]]:
        """Waiting requests to start in this step, in arrival order: while the step has token budget left
        (or computed nothing yet: a step always makes progress), the batch has room and their live KV
        fits (see the module docstring). One exception to the order: while a prefill is in progress, a
        request whose cost (:meth:`_cost`) does not fit in what is left of the step stays in its place
        and the requests behind it may start (starting it would slow the prefills in progress without
        finishing its own: every prompt of a burst would get its first token late); it starts when they
        are done."""
        cfg = self.config
        admitted: list[_Entry[S, J]] = []
        starting: list[Admission] = []
        held = self.runner.live_kv_bytes() if cfg.max_live_kv_bytes is not None else 0
        index = 0
        while index < len(self.waiting) and self.num_running + len(admitted) < cfg.max_running:
            entry = self.waiting[index]
            if entry.admission is None:
                try:
                    entry.admission = self.runner.admission(entry.request)
                except ValueError as exc:
                    self._end(entry, "error", outputs, exc)
                    continue
            need = entry.admission
            if budget <= 0 and (computed or admitted):
                break
            cost = self._cost(entry)
            if self.prefilling and cost > budget:
                index += 1
                continue
            if not cfg.chunked_prefill and cost > budget and (computed or admitted):
                break
            if not self._kv_fits(held, [*starting, need]):
                if self.running or self.prefilling or admitted:
                    break  # waits until running sequences free their KV
                if cfg.max_live_kv_bytes is not None and need.kv_bytes > cfg.max_live_kv_bytes:
                    error = ValueError(
                        f"request {entry.request_id} needs {need.kv_bytes} bytes of live KV (prompt +"
                        f" max_new_tokens); max_live_kv_bytes is {cfg.max_live_kv_bytes}"
                    )
                    self._end(entry, "error", outputs, error)
                    continue
            del self.waiting[index]
            admitted.append(entry)
            starting.append(need)
            budget -= cost
        return admitted

    def _begin(self, entry: _Entry[S, J], outputs: list[StepOutput]) -> bool:
        """Plan an admitted request; False if it failed (and ended)."""
        try:
            entry.stream = self.runner.text_stream(entry.request)
            entry.job = self.runner.begin_prefill(entry.request)
        except Exception as exc:  # a request that cannot run ends alone; the others go on
            self._fail_prefill(entry, exc, outputs)
            return False
        self.prefilling.append(entry)
        return True

    def _advance(
        self, entry: _Entry[S, J], budget: int, computed: int, outputs: list[StepOutput]
    ) -> tuple[int, int]:
        """Advance a prefill within ``budget`` tokens; returns (1 if it completed else 0, tokens computed).
        A job that cannot be chunked runs whole, in a step of its own unless it fits the budget."""
        job = entry.job
        assert job is not None
        chunked = self.config.chunked_prefill and job.chunkable
        if computed and (budget <= 0 or (not chunked and job.remaining > budget)):
            return 0, 0  # next step
        try:
            tokens = self.runner.advance_prefill(job, max(1, budget) if chunked else None)
            if not job.done:
                return 0, tokens
            entry.seq = self.runner.complete_prefill(job)
        except Exception as exc:
            self._fail_prefill(entry, exc, outputs)
            return 0, 0
        self.prefilling.remove(entry)
        entry.job = None
        self.running.append(entry)
        try:
            output = self._emit(entry)
        except Exception as exc:  # its first token's stop check: this request ends alone
            self._end_alone(entry, exc, outputs)
            return 1, tokens
        try:
            self.runner.store_prefill(entry.seq)
            self._stored += 1
        except Exception as exc:  # storing is an optimisation for later requests, never this one's failure
            log.warning("storing the prefill of %s failed: %s", entry.request_id, exc)
        try:
            self._settle(entry, output, outputs)
        except Exception as exc:
            self._end_alone(entry, exc, outputs)
        return 1, tokens

    def _fail_prefill(self, entry: _Entry[S, J], exc: Exception, outputs: list[StepOutput]) -> None:
        log.warning(
            "prefill of %s failed: %s", entry.request_id, exc, exc_info=not isinstance(exc, ValueError)
        )
        entry.seq = None
        self._end(entry, "error", outputs, exc, started=False)

    def _decode(self, batch: list[_Entry[S, J]], outputs: list[StepOutput]) -> None:
        """One batched decode of ``batch``. A sequence that failed alone in it (``seq.failure``: its
        sampling, loop repair or sparse selection raised) ends with that error, as does one whose stop
        check or result raises (:meth:`_settle_alone`); the others go on. Only a step that fails as a
        whole ends every entry of it."""
        try:
            self.runner.decode_batch([e.seq for e in batch if e.seq is not None])
        except Exception as exc:
            log.error("a batched decode step failed: %s", exc, exc_info=exc)
            for entry in batch:
                self._end(entry, "error", outputs, exc)
            return
        for entry in batch:
            failure = entry.seq.failure if entry.seq is not None else None
            if failure is not None:
                self._end(entry, "error", outputs, failure)
            else:
                self._settle_alone(entry, outputs)

    def _settle_alone(self, entry: _Entry[S, J], outputs: list[StepOutput]) -> None:
        """Emit and settle one entry after a decode step; if that raises (its stop check, its
        detokenizer, its result), the entry alone ends with the error."""
        try:
            self._settle(entry, self._emit(entry), outputs)
        except Exception as exc:
            self._end_alone(entry, exc, outputs)

    def _end_alone(self, entry: _Entry[S, J], exc: Exception, outputs: list[StepOutput]) -> None:
        """End one entry whose own output handling raised (no result is built: that may be what raised)."""
        log.warning("ending %s: %s: %s", entry.request_id, type(exc).__name__, exc, exc_info=exc)
        self._end(entry, "error", outputs, exc, started=False)

    def _emit(self, entry: _Entry[S, J]) -> StepOutput:
        """The tokens and text the sequence produced since the last emit."""
        output = StepOutput(entry.request_id)
        stream, seq = entry.stream, entry.seq
        assert stream is not None and seq is not None
        pieces: list[str] = []

        def on_token(token: int) -> bool:
            output.token_ids.append(token)
            pieces.append(stream.push(token))
            return not stream.stopped

        seq.emit_pending(on_token)
        output.text = "".join(pieces)
        return output

    def _settle(self, entry: _Entry[S, J], output: StepOutput, outputs: list[StepOutput]) -> None:
        """Report ``output``; a finished sequence leaves the batch with its generation."""
        seq = entry.seq
        assert seq is not None
        if seq.finished:
            output.finished = True
            output.finish_reason = seq.finish_reason
            output.text += self._tail(entry)
            output.generation = self._result(entry)
            self._forget(entry)
        if output.token_ids or output.text or output.finished:
            outputs.append(output)

    def _tail(self, entry: _Entry[S, J]) -> str:
        return entry.stream.finish() if entry.stream is not None else ""

    def _result(self, entry: _Entry[S, J]) -> Generation | None:
        if entry.seq is None:
            return None
        generation = self.runner.finish(entry.seq)
        if entry.stream is not None and entry.stream.stopped:
            generation = replace(generation, text=entry.stream.text)
        return generation

    def _end(
        self,
        entry: _Entry[S, J],
        reason: str,
        outputs: list[StepOutput],
        error: BaseException | None = None,
        started: bool = True,
    ) -> None:
        """End a request early (abort, deadline, error) and free its sequence."""
        generation = None
        if started and entry.seq is not None:
            try:
                generation = self._result(entry)
            except Exception as exc:  # the request ends either way
                log.warning("closing %s failed: %s", entry.request_id, exc)
        outputs.append(
            StepOutput(
                entry.request_id, finished=True, finish_reason=reason, generation=generation, error=error
            )
        )
        self._forget(entry)

    def _forget(self, entry: _Entry[S, J]) -> None:
        if entry in self.waiting:
            self.waiting.remove(entry)
        if entry in self.prefilling:
            self.prefilling.remove(entry)
        if entry in self.running:
            self.running.remove(entry)
        entry.seq = entry.job = None  # the live cache is freed with the sequence
        with self._lock:
            self._live_ids.discard(entry.request_id)
