"""The server on the scheduler, over a real uvicorn server: concurrent streams decode together; clients
that drop (streaming or not) and requests past their deadline are freed; nothing is lost or answered twice.

Injected: concurrent streaming clients; clients closing their connection mid-stream or before a
non-streamed answer; a server deadline shorter than a long generation. Must happen: outputs equal
the same requests served alone; /metrics shows steps that decoded several sequences; a dropped client's
sequence ends with reason "abort" long before it could have finished; a deadline is a 504
``deadline_exceeded`` (an SSE error event once streaming); every request ends exactly once
(``semkv_requests_ended_total``) and /health's queue drains to 0; ``semkv_live_kv_bytes`` shows a running
sequence's KV and drops to 0 once it is freed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from semkv.server import ServerConfig
from tests.server.test_concurrency import live_server  # noqa: F401  (fixture)

TINY = "tiny"
LONG = {"max_tokens": 1500, "semkv": {"stop_at_eos": False}}


def metric(base: str, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 if absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.rsplit(" ", 1)[0] == want:
            return float(line.split()[-1])
    return 0.0


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def stream_text(base: str, body: dict) -> tuple[str, int]:
    """(text, [DONE] count) of one streamed completion."""
    parts, done = [], 0
    with httpx.Client(base_url=base, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    parts += [choice["text"] for choice in chunk["choices"]]
    return "".join(parts), done


def test_concurrent_streams_decode_together_and_equal_serial(live_server):  # noqa: F811
    base = live_server()
    bodies = [
        {"model": TINY, "prompt": f"Story {i}: once upon a time in town {i * 13}", "max_tokens": 12 + 3 * i}
        for i in range(6)
    ]
    for body in bodies:
        body["semkv"] = {"stop_at_eos": False, "reuse": "none", "store_prompt": False}
    alone = [stream_text(base, body) for body in bodies]
    assert metric(base, "semkv_step_batch_size_bucket", le="1.0") == metric(
        base, "semkv_step_batch_size_count"
    )  # one at a time: never more than one row
    results: list = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def client(i: int) -> None:
        barrier.wait()
        results[i] = stream_text(base, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == alone and all(done == 1 for _, done in results)
    batched_steps = metric(base, "semkv_step_batch_size_count") - metric(
        base, "semkv_step_batch_size_bucket", le="1.0"
    )
    assert batched_steps >= 5  # steps that decoded 2+ sequences in one forward
    assert metric(base, "semkv_requests_ended_total", reason="length") == 2 * len(bodies)
    health = httpx.get(f"{base}/health").json()
    assert health["queue"] == health["running"] == health["waiting"] == 0


def test_clients_dropping_free_their_sequences(live_server):  # noqa: F811
    base = live_server()
    body = {"model": TINY, "prompt": "Tell me a very long story.", **LONG}
    # streaming: read two chunks, then close the connection
    with httpx.Client(base_url=base, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            # its cache: (prompt + 1500) rows x 2 layers x 2 KV heads x 16 dims x 3 buffers of >= 2 bytes
            wait_until(lambda: metric(base, "semkv_live_kv_bytes") >= 1500 * 2 * 2 * 16 * 3 * 2)
    wait_until(lambda: metric(base, "semkv_requests_ended_total", reason="abort") == 1)
    wait_until(lambda: metric(base, "semkv_live_kv_bytes") == 0)  # its KV went back with it
    # not streaming: the client gives up before the answer
    try:
        httpx.post(f"{base}/v1/completions", json=body, timeout=0.5)
        raise AssertionError("a 1500-token answer came back within 0.5 s")
    except httpx.TimeoutException:
        pass
    wait_until(lambda: metric(base, "semkv_requests_ended_total", reason="abort") == 2)
    wait_until(lambda: httpx.get(f"{base}/health").json()["queue"] == 0)
    assert metric(base, "semkv_completion_tokens_total") == 0  # neither ran to its end
    assert metric(base, "semkv_requests_ended_total", reason="length") == 0
    ok = httpx.post(
        f"{base}/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 3}, timeout=60
    )
    assert ok.status_code == 200


def test_deadline_ends_a_request_with_a_clear_error(live_server):  # noqa: F811
    base = live_server(ServerConfig(request_timeout_s=0.3))
    body = {"model": TINY, "prompt": "Tell me a very long story.", **LONG}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert "deadline of 0.3 s" in r.json()["error"]["message"]
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "deadline_exceeded"
    assert metric(base, "semkv_requests_ended_total", reason="deadline") == 2
    short = httpx.post(
        f"{base}/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert short.status_code == 200


def test_mixed_drops_lose_nothing_and_answer_once(live_server):  # noqa: F811
    """8 concurrent streams, every other one dropped after its first chunk: each kept stream gets its
    full answer and one [DONE]; every request ends exactly once."""
    base = live_server()
    bodies = [
        {"model": TINY, "prompt": f"Item {i} of the list", "max_tokens": 40, "semkv": {"stop_at_eos": False}}
        for i in range(8)
    ]
    alone = {i: stream_text(base, bodies[i]) for i in range(0, 8, 2)}
    kept: dict[int, tuple[str, int]] = {}
    barrier = threading.Barrier(8)

    def client(i: int) -> None:
        barrier.wait()
        if i % 2 == 0:
            kept[i] = stream_text(base, bodies[i])
            return
        with httpx.Client(base_url=base, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={**bodies[i], "stream": True}) as r:
                next(r.iter_lines())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert kept == alone
    wait_until(lambda: httpx.get(f"{base}/health").json()["queue"] == 0)
    ended = {
        reason: metric(base, "semkv_requests_ended_total", reason=reason)
        for reason in ("length", "abort", "eos", "stop", "error", "deadline")
    }
    # 4 alone + 4 kept ran to their length; a dropped one ends by abort, or by length if it finished
    # before the server noticed the drop: either way exactly once
    assert ended["length"] + ended["abort"] == 12 and ended["abort"] >= 1
    assert ended["error"] == ended["deadline"] == 0
