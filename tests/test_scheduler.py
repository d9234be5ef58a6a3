"""The scheduler's decisions, without a model: ids, admission order and limits, abort, deadline, stop.

The runner below does the model's part with a rule instead of a forward pass (sequence i's next token is
a function of its request and length), so every test knows the exact tokens and which sequences must
be decoded together in each step; the sequences are real :class:`semkv.sequence.Sequence` objects
(real sampling, EOS and stop handling). What must hold: ids are exact and unique; requests are
admitted in arrival order within max_running / max_batched_tokens / max_live_kv_bytes; a request
joining is prefilled in its step and decoded from the next; aborted, expired and failing requests end
with exactly one finished output and leave the batch at the next step; no request is lost or answered
twice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import pytest
import torch

from semkv.config import SchedulerConfig
from semkv.request import GenerateRequest, Generation
from semkv.scheduler import Admission, DeadlineExceeded, QueueFull, Scheduler, StepOutput
from semkv.sequence import Sequence
from semkv.text_stream import TextStream

VOCAB = 32
EOS = 2
BYTES_PER_TOKEN = 10


class LetterTokenizer:
    """Token id t is the letter chr(ord('a') + t % 26); EOS (2) is special (skipped)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: object) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if not (skip_special_tokens and t == EOS))


def next_token(request: GenerateRequest, length: int) -> int:
    """The runner's rule: 3 + (seed + length) % 20 (never EOS), unless the prompt asks for EOS."""
    if request.prompt is not None and "eos" in request.prompt and length == 2:
        return EOS
    return 3 + (request.seed + length) % 20


@dataclass
class RuleJob:
    """A prefill in progress: prompt words left to compute."""

    request: GenerateRequest
    remaining: int
    chunkable: bool = True

    @property
    def done(self) -> bool:
        return self.remaining == 0


@dataclass
class RuleRunner:
    """A StepRunner whose forward pass is :func:`next_token`; it records what each step ran. Its live KV
    is what its jobs and sequences still alive were admitted with (their own caches, no arena)."""

    prefills: list[str] = field(default_factory=list)  # prompts, in order of prefill completion
    chunks: list[tuple[str, int]] = field(default_factory=list)  # (prompt, tokens) of each prefill piece
    batches: list[list[str]] = field(default_factory=list)  # prompts of each decode_batch call
    fail_prefill: str | None = None
    live: list[tuple[weakref.ref, int]] = field(default_factory=list)  # (job or sequence, its KV bytes)
    outside_kv: int = 0  # KV bytes held by something the scheduler does not run
    stored: set[str] | None = None  # prefix reuse, one word per block: the stored blocks' keys (None: off)
    cost_lookups: int = 0  # calls of cached_prompt_tokens

    def admission(self, request: GenerateRequest) -> Admission:
        words = len((request.prompt or "").split())
        if words == 0:
            raise ValueError("prompt is empty after tokenization")
        rows = words + request.max_new_tokens
        if self.stored is None:
            return Admission(words, rows * BYTES_PER_TOKEN, rows)
        return Admission(words, rows * BYTES_PER_TOKEN, rows, prefix_keys(request), 1)

    def cached_prompt_tokens(self, admission: Admission) -> int:
        self.cost_lookups += 1
        if self.stored is None:
            return 0
        found = next((i for i, key in enumerate(admission.prefix_keys) if key not in self.stored), None)
        return min(len(admission.prefix_keys) if found is None else found, admission.prompt_tokens - 1)

    def live_kv_bytes(self) -> int:
        return self.outside_kv + sum(nbytes for ref, nbytes in self.live if ref() is not None)

    def kv_bytes_to_admit(self, admissions: list[Admission]) -> int:
        return sum(a.kv_bytes for a in admissions)

    def reclaim_kv(self) -> None:
        self.live = [(ref, nbytes) for ref, nbytes in self.live if ref() is not None]

    def _hold(self, owner: object, request: GenerateRequest) -> None:
        self.live.append((weakref.ref(owner), self.admission(request).kv_bytes))

    def _sample(self, seq: Sequence) -> None:
        logits = torch.zeros(VOCAB)
        logits[next_token(seq.request, len(seq.tokens))] = 1.0
        seq.sample(logits)

    def begin_prefill(self, request: GenerateRequest) -> RuleJob:
        if request.prompt == self.fail_prefill:
            raise RuntimeError("injected prefill failure")
        job = RuleJob(request, len(str(request.prompt).split()), chunkable="whole" not in str(request.prompt))
        if self.stored is not None:  # load the stored leading blocks, compute and store the rest
            keys = prefix_keys(request)
            loaded = next((i for i, key in enumerate(keys) if key not in self.stored), len(keys))
            loaded = min(loaded, len(keys) - 1)  # the last token is always computed
            job.remaining -= loaded
        self._hold(job, request)
        return job

    def advance_prefill(self, job: RuleJob, max_tokens: int | None = None) -> int:
        take = job.remaining if max_tokens is None else min(job.remaining, max_tokens)
        job.remaining -= take
        self.chunks.append((str(job.request.prompt), take))
        return take

    def complete_prefill(self, job: RuleJob) -> Sequence:
        assert job.done
        self.prefills.append(str(job.request.prompt))
        seq = Sequence(
            job.request, None, None, None, [], None, None, None, torch.Generator(), frozenset({EOS}), 0.1
        )  # type: ignore[arg-type]  # the fields a model fills are not read here
        self._sample(seq)
        self._hold(seq, job.request)
        return seq

    def store_prefill(self, seq: Sequence) -> float:
        if self.stored is not None:
            self.stored.update(prefix_keys(seq.request))
        return 0.0

    def decode_batch(self, seqs: list[Sequence]) -> None:
        self.batches.append([str(s.request.prompt) for s in seqs])
        for seq in seqs:
            self._sample(seq)

    def finish(self, seq: Sequence) -> Generation:
        ids = seq.output_ids()
        return Generation(LetterTokenizer().decode(ids), ids, {"finish_reason": seq.finish_reason})

    def text_stream(self, request: GenerateRequest) -> TextStream:
        return TextStream(LetterTokenizer(), request.stop)


def prefix_keys(request: GenerateRequest) -> tuple[str, ...]:
    """The rule runner's chained block keys: one word per block, in the request's namespace."""
    words = str(request.prompt).split()
    return tuple(f"{request.cache_salt}|{' '.join(words[: i + 1])}" for i in range(len(words)))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(prompt: str, max_new_tokens: int = 3, seed: int = 0, **kw: object) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, seed=seed, **kw)


def expected_tokens(req: GenerateRequest) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < req.max_new_tokens:
        tokens.append(next_token(req, len(tokens)))
        if tokens[-1] == EOS:
            break
    return tokens


def run_all(scheduler: Scheduler, limit: int = 100) -> dict[str, list[StepOutput]]:
    """Step until nothing is left; outputs by request id."""
    by_id: dict[str, list[StepOutput]] = {}
    for _ in range(limit):
        if not scheduler.has_unfinished():
            return by_id
        for out in scheduler.step():
            by_id.setdefault(out.request_id, []).append(out)
    raise AssertionError("the scheduler did not finish")


def finished_once(outputs: list[StepOutput]) -> StepOutput:
    """Exactly one finished output, and it is the last one."""
    ends = [o for o in outputs if o.finished]
    assert len(ends) == 1 and outputs[-1] is ends[0], outputs
    return ends[0]


def test_ids_are_exact_and_unique():
    scheduler = Scheduler(RuleRunner())
    assert [scheduler.add_request(request(f"p{i}")) for i in range(3)] == ["req-0", "req-1", "req-2"]
    assert scheduler.add_request(request("mine"), request_id="mine") == "mine"
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(request("again"), request_id="mine")
    assert scheduler.num_waiting == 4 and scheduler.num_running == 0
    outputs = run_all(scheduler)
    assert sorted(outputs) == ["mine", "req-0", "req-1", "req-2"]
    assert scheduler.add_request(request("reused"), request_id="mine") == "mine"  # free once finished


def test_tokens_equal_the_rule_and_join_the_batch_the_step_after_prefill():
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8))
    reqs = {scheduler.add_request(request(f"a{i}", max_new_tokens=2 + i, seed=i)): i for i in range(3)}
    outputs = scheduler.step()
    assert runner.prefills == ["a0", "a1", "a2"] and runner.batches == []  # prefill step: no decode
    assert [o.token_ids for o in outputs] == [[next_token(request("x", seed=i), 0)] for i in range(3)]
    late = scheduler.add_request(request("late", max_new_tokens=2, seed=9))
    outputs += scheduler.step()
    assert runner.batches == [["a0", "a1", "a2"]] and runner.prefills[-1] == "late"
    outputs += scheduler.step()
    assert runner.batches[-1] == ["a1", "a2", "late"]  # a0 (2 tokens) left, late joined
    for outs in run_all(scheduler).values():
        outputs += outs
    assert runner.batches[-1] == ["a2"]
    by_id = {rid: [o for o in outputs if o.request_id == rid] for rid in [*reqs, late]}
    for rid, i in reqs.items():
        want = expected_tokens(request(f"a{i}", max_new_tokens=2 + i, seed=i))
        assert finished_once(by_id[rid]).generation.token_ids == want
        assert [t for o in by_id[rid] for t in o.token_ids] == want
    assert finished_once(by_id[late]).generation.token_ids == expected_tokens(
        request("late", max_new_tokens=2, seed=9)
    )


def test_whole_outputs_equal_one_at_a_time():
    reqs = [request(f"p{i} " * (i + 1), max_new_tokens=1 + i % 4, seed=i) for i in range(7)]
    reqs.append(request("stops at eos", max_new_tokens=6))
    for limit in (1, 3, 8):
        scheduler = Scheduler(RuleRunner(), SchedulerConfig(max_running=limit))
        ids = [scheduler.add_request(r) for r in reqs]
        outputs = run_all(scheduler)
        for rid, req in zip(ids, reqs, strict=True):
            end = finished_once(outputs[rid])
            streamed = [t for o in outputs[rid] for t in o.token_ids]
            want = [t for t in expected_tokens(req) if t != EOS]
            assert streamed == want == end.generation.token_ids, (limit, rid)
            assert end.finish_reason == ("eos" if "eos" in str(req.prompt) else "length")


def test_admission_in_arrival_order_within_max_running():
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=2))
    for i in range(5):
        scheduler.add_request(request(f"r{i}", max_new_tokens=2 if i == 0 else 4))
    scheduler.step()
    assert runner.prefills == ["r0", "r1"] and scheduler.num_running == 2 and scheduler.num_waiting == 3
    scheduler.step()  # r0 finishes (2 tokens): its slot frees for the next step
    assert runner.prefills == ["r0", "r1"] and scheduler.num_running == 1
    scheduler.step()
    assert runner.prefills == ["r0", "r1", "r2"]
    run_all(scheduler)
    assert runner.prefills == ["r0", "r1", "r2", "r3", "r4"]
    assert max(len(b) for b in runner.batches) == 2


LONG = "g h i j k l m n o p"  # 10 tokens


def test_chunked_prefill_runs_between_decode_steps():
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_batched_tokens=6))
    for prompt in ("a b c", "d e f", LONG, "q"):
        scheduler.add_request(request(prompt))
    run_all(scheduler)
    # step 1: 3 + 3 tokens; step 2: 2 decode rows + a 4-token chunk of LONG; step 3: q waits, so LONG
    # takes half of the 4 tokens left and q is prefilled; step 4: 1 decode row + LONG's last 4
    assert runner.chunks == [("a b c", 3), ("d e f", 3), (LONG, 4), (LONG, 2), ("q", 1), (LONG, 4)]
    assert runner.batches[:2] == [["a b c", "d e f"], ["a b c", "d e f"]]  # streams went on meanwhile
    assert runner.prefills == ["a b c", "d e f", "q", LONG]  # q, arriving during LONG, finished first


def test_an_arrival_during_a_long_chunked_prefill_starts_in_the_next_step():
    """A short request added while a 40-token prompt is prefilled in 8-token chunks gets its first token
    in the next step (the long prefill yields half of the budget while a request waits), and arrivals
    every step never starve the long prefill: it still computes half of the step's budget left after the
    decode rows (3 or 4 tokens) every step."""
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_batched_tokens=8))
    long_prompt = " ".join(f"w{i}" for i in range(40))
    scheduler.add_request(request(long_prompt))
    scheduler.step()
    assert runner.chunks == [(long_prompt, 8)]
    short = scheduler.add_request(request("s t"))
    outputs = scheduler.step()
    assert runner.chunks[1:] == [(long_prompt, 4), ("s t", 2)]
    assert [o.request_id for o in outputs if o.token_ids] == [short]  # its first token, this step
    for i in range(20):  # an arrival every step
        scheduler.add_request(request(f"x{i}", max_new_tokens=1))
        scheduler.step()
        if long_prompt in runner.prefills:
            break
    long_chunks = [n for prompt, n in runner.chunks if prompt == long_prompt]
    assert sum(long_chunks) == 40 and min(long_chunks[:-1]) >= 3, long_chunks  # the last: what was left
    run_all(scheduler)


def test_a_request_waiting_for_live_kv_does_not_slow_the_long_prefill():
    """A short request that arrives during a long chunked prefill but whose live KV does not fit beside
    it cannot start before the long one has finished: the long prefill keeps the whole step budget (8
    tokens per step, not the half it yields to a request that could start); the short one runs after."""
    runner = RuleRunner()
    long_prompt = " ".join(f"w{i}" for i in range(40))
    long_kv = (40 + 3) * BYTES_PER_TOKEN
    scheduler = Scheduler(
        runner, SchedulerConfig(max_running=8, max_batched_tokens=8, max_live_kv_bytes=long_kv + 10)
    )
    first = scheduler.add_request(request(long_prompt))
    scheduler.step()
    short = scheduler.add_request(request("s t"))  # (2 + 3) rows: does not fit beside the long one
    while long_prompt not in runner.prefills:
        scheduler.step()
    assert [n for prompt, n in runner.chunks if prompt == long_prompt] == [8, 8, 8, 8, 8]
    assert "s t" not in runner.prefills and scheduler.num_waiting == 1
    outputs = run_all(scheduler)
    assert runner.prefills == [long_prompt, "s t"]
    assert finished_once(outputs[first]).finish_reason == "length"
    assert finished_once(outputs[short]).finish_reason == "length"


def test_unchunked_prefill_runs_whole_in_a_step_that_computes_nothing_else():
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_batched_tokens=6, chunked_prefill=False))
    for prompt in ("a b c", "whole " + LONG, "d e f"):
        scheduler.add_request(request(prompt))
    scheduler.step()
    assert runner.chunks == [("a b c", 3)]  # the 11-token one does not fit after it
    scheduler.step()
    assert runner.chunks[-1] == ("whole " + LONG, 11) and len(runner.chunks) == 2  # alone, never starved
    run_all(scheduler)
    assert runner.prefills == ["a b c", "whole " + LONG, "d e f"]


def test_abort_frees_the_sequence_at_the_next_step():
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=2))
    a = scheduler.add_request(request("a", max_new_tokens=10))
    b = scheduler.add_request(request("b", max_new_tokens=10))
    waiting = scheduler.add_request(request("w", max_new_tokens=10))
    scheduler.step()
    assert scheduler.abort(a) and scheduler.abort(waiting)
    assert not scheduler.abort("no-such-id")
    outputs = scheduler.step()
    ends = {o.request_id: o for o in outputs if o.finished}
    assert ends[a].finish_reason == "abort" and ends[a].generation is not None
    assert ends[a].generation.token_ids == expected_tokens(request("a", max_new_tokens=10))[:1]
    assert ends[waiting].finish_reason == "abort" and ends[waiting].generation is None
    assert runner.batches == [["b"]] and scheduler.num_running == 1 and scheduler.num_waiting == 0
    assert not scheduler.abort(a)  # already gone
    rest = run_all(scheduler)
    assert set(rest) == {b} and finished_once(rest[b]).finish_reason == "length"
    assert "w" not in runner.prefills


def test_deadline_ends_waiting_and_running_requests_with_an_error():
    clock = Clock()
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=1), clock=clock)
    running = scheduler.add_request(request("run", max_new_tokens=10), timeout_s=5.0)
    queued = scheduler.add_request(request("queued", max_new_tokens=2), timeout_s=1.0)
    free = scheduler.add_request(request("free", max_new_tokens=2))
    scheduler.step()
    clock.now += 2.0
    ends = {o.request_id: o for o in scheduler.step() if o.finished}
    assert ends[queued].finish_reason == "deadline" and isinstance(ends[queued].error, DeadlineExceeded)
    assert "1 s while waiting" in str(ends[queued].error)
    clock.now += 4.0
    ends = {o.request_id: o for o in scheduler.step() if o.finished}
    assert ends[running].finish_reason == "deadline" and "while decoding" in str(ends[running].error)
    assert len(ends[running].generation.token_ids) == 2  # what it had produced
    rest = run_all(scheduler)
    assert finished_once(rest[free]).finish_reason == "length" and "queued" not in runner.prefills
    with pytest.raises(ValueError, match="timeout_s"):
        scheduler.add_request(request("x"), timeout_s=0)


def test_deadline_counts_from_arrival_before_the_request_was_queued():
    """A request that waited ``waited_s`` before it reached the scheduler (a server tokenizing it behind
    other work) has that much less time: past its deadline already, it ends at the next step unrun."""
    clock = Clock()
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=4), clock=clock)
    late = scheduler.add_request(request("late", max_new_tokens=2), timeout_s=1.0, waited_s=1.5)
    near = scheduler.add_request(request("near", max_new_tokens=8), timeout_s=1.0, waited_s=0.5)
    ends = {o.request_id: o for o in scheduler.step() if o.finished}
    assert ends[late].finish_reason == "deadline" and "1 s while waiting" in str(ends[late].error)
    assert "late" not in runner.prefills and near not in ends
    clock.now += 0.6
    ends = {o.request_id: o for o in scheduler.step() if o.finished}
    assert ends[near].finish_reason == "deadline"


def test_live_kv_budget_makes_admission_wait_and_refuses_what_never_fits():
    runner = RuleRunner()
    one = (1 + 3) * BYTES_PER_TOKEN  # a one-word prompt + 3 new tokens
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_live_kv_bytes=one + one // 2))
    first = scheduler.add_request(request("a"))
    second = scheduler.add_request(request("b"))
    huge = scheduler.add_request(request("c " * 10))
    scheduler.step()
    assert runner.prefills == ["a"] and scheduler.num_waiting == 2  # b waits for a's KV
    outputs = run_all(scheduler)
    assert runner.prefills == ["a", "b"]
    assert finished_once(outputs[first]).finish_reason == "length"
    assert finished_once(outputs[second]).finish_reason == "length"
    refused = finished_once(outputs[huge])
    assert refused.finish_reason == "error" and "max_live_kv_bytes" in str(refused.error)


def test_live_kv_counts_what_the_runner_holds_and_never_deadlocks():
    """Admission counts the bytes the runner really holds (here some held outside the scheduler), not a
    sum of reservations: a request that fits the limit alone but not beside them waits while others run;
    with nothing running it is admitted anyway (waiting could never free that memory), and one that can
    never fit the limit alone ends with the clear error."""
    one = (1 + 3) * BYTES_PER_TOKEN
    runner = RuleRunner(outside_kv=one)
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_live_kv_bytes=2 * one))
    first = scheduler.add_request(request("a"))
    second = scheduler.add_request(request("b"))
    huge = scheduler.add_request(request("c " * 10))
    scheduler.step()
    assert runner.prefills == ["a"] and scheduler.num_waiting == 2  # b does not fit beside a + outside
    assert scheduler.last_step.live_kv_bytes == 2 * one
    outputs = run_all(scheduler)
    assert runner.prefills == ["a", "b"]  # b alone with the outside bytes: 2 * one, admitted
    assert (
        finished_once(outputs[first]).finish_reason
        == finished_once(outputs[second]).finish_reason
        == "length"
    )
    refused = finished_once(outputs[huge])
    assert refused.finish_reason == "error" and "max_live_kv_bytes" in str(refused.error)
    runner.outside_kv = 3 * one  # more than the limit, with nothing running: the next request still runs
    late = scheduler.add_request(request("d"))
    assert finished_once(run_all(scheduler)[late]).finish_reason == "length"


def test_stop_string_ends_the_request_and_cuts_the_text():
    # seed 0: tokens 3, 4, 5, ... -> letters d, e, f, ...
    scheduler = Scheduler(RuleRunner())
    rid = scheduler.add_request(request("s", max_new_tokens=8, stop=["fg"]))
    outputs = run_all(scheduler)[rid]
    end = finished_once(outputs)
    assert end.finish_reason == "stop" and end.generation.text == "de"
    assert "".join(o.text for o in outputs) == "de"


def test_queue_full_and_failures_end_only_their_request():
    runner = RuleRunner(fail_prefill="boom")
    scheduler = Scheduler(runner, SchedulerConfig(max_waiting=3))
    ok = scheduler.add_request(request("fine"))
    bad = scheduler.add_request(request("boom"))
    empty = scheduler.add_request(request(" ", chunks=["context"]))  # no prompt words: admission refuses
    with pytest.raises(QueueFull):
        scheduler.add_request(request("one too many"))
    outputs = run_all(scheduler)
    assert finished_once(outputs[bad]).finish_reason == "error"
    assert "injected" in str(finished_once(outputs[bad]).error)
    assert finished_once(outputs[empty]).finish_reason == "error"
    assert finished_once(outputs[ok]).finish_reason == "length"
    assert not scheduler.has_unfinished()


def computed(runner: RuleRunner, prefix: str) -> int:
    """Prompt tokens the runner computed for the prompt starting with ``prefix``."""
    return sum(n for prompt, n in runner.chunks if prompt.startswith(prefix))


def test_prefix_hits_cost_the_budget_only_their_new_tokens():
    """Three requests arrive while A (24 tokens) is prefilled; each starts with A's first 20. They wait
    for A (a 24-token prompt cannot finish in what A leaves of a 16-token step). Once A is stored, each
    costs the budget only its 4 new tokens (the runner counts the stored prefix it will load), so two of
    them start in the step A completes and the third in the next; counting whole prompts (24 tokens each)
    would start one per step: [2, 1, 1]."""
    runner = RuleRunner(stored=set())
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_batched_tokens=16))
    shared = " ".join(f"w{i}" for i in range(20))
    scheduler.add_request(request(shared + " a0 a1 a2 a3"))
    scheduler.step()
    for name in "bcd":
        scheduler.add_request(request(shared + " " + " ".join(f"{name}{i}" for i in range(4))))
    steps = []
    while scheduler.has_unfinished():
        before = len(runner.prefills)
        scheduler.step()
        steps.append(runner.prefills[before:])
    assert [len(step) for step in steps if step] == [3, 1]  # A + b + c (8 + 4 + 4 tokens), then d
    assert computed(runner, "w0") == 24 + 3 * 4


def test_a_long_prompt_waits_for_the_chunked_prefill_in_progress():
    """A and B, 24 words each, with 8-token steps; B arrives while A is prefilled. B cannot finish in the
    half step it would get, so it does not start (it would only slow A): A keeps whole steps. A short
    request arriving behind B starts at once (A's step is halved for it); A gets its first token in its
    4th step, and B starts in that step with what is left. Splitting the budget between A and B from
    B's arrival on would give A its first token in its 5th step."""
    runner = RuleRunner()
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_batched_tokens=8))
    a = " ".join(f"a{i}" for i in range(24))
    b = " ".join(f"b{i}" for i in range(24))
    scheduler.add_request(request(a))
    scheduler.step()
    scheduler.add_request(request(b))
    scheduler.step()
    scheduler.add_request(request("s t"))
    scheduler.step()
    assert runner.chunks == [(a, 8), (a, 8), (a, 4), ("s t", 2)]  # the short one halves A's step
    assert runner.prefills == ["s t"]
    scheduler.step()
    assert runner.prefills == ["s t", a] and runner.chunks[4:] == [(a, 4), (b, 3)]  # 8 - 1 decode row
    run_all(scheduler)
    assert runner.prefills[-1] == b


def test_a_prefix_hit_starts_during_a_long_prefill():
    """While a 40-token prompt is prefilled in 8-token steps, B arrives: 20 stored tokens and 2 new ones.
    It costs 2 tokens, so it starts at once (the long prefill's step is halved for it) and loads the
    stored 20; counted as a 22-token prompt it would wait for the whole long prefill."""
    runner = RuleRunner(stored=set())
    shared = [f"w{i}" for i in range(20)]
    runner.stored.update(prefix_keys(request(" ".join(shared))))
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_batched_tokens=8))
    long_prompt = " ".join(f"x{i}" for i in range(40))
    scheduler.add_request(request(long_prompt))
    scheduler.step()
    hit = " ".join(shared + ["b0", "b1"])
    scheduler.add_request(request(hit))
    scheduler.step()
    assert runner.prefills == [hit] and runner.chunks[1:] == [(long_prompt, 4), (hit, 2)]
    run_all(scheduler)


def test_a_waiting_request_is_costed_once_until_a_prefill_is_stored():
    """B (24 tokens) waits behind A's 48-token prefill (8-token steps): the store is asked for B's
    cached prefix once, not in every step, and once more after A is stored."""
    runner = RuleRunner(stored=set())
    scheduler = Scheduler(runner, SchedulerConfig(max_running=8, max_batched_tokens=8))
    scheduler.add_request(request(" ".join(f"a{i}" for i in range(48))))
    scheduler.step()
    scheduler.add_request(request(" ".join(f"b{i}" for i in range(24))))
    for _ in range(4):
        scheduler.step()
    assert runner.prefills == [] and runner.cost_lookups == 2  # A when admitted, B once
    scheduler.step()  # A completes with the step's whole budget and is stored
    assert runner.prefills[0].startswith("a0") and runner.cost_lookups == 2
    scheduler.step()  # B is costed again and starts
    assert runner.cost_lookups == 3 and runner.chunks[-1][0].startswith("b0")
    run_all(scheduler)
