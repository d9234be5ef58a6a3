"""Prometheus metrics of one server: its own registry (several apps in one process never collide).

Request metrics are updated as requests finish; store metrics are read from the
store's counters at scrape time (one source of truth, nothing double-counted):
every field of every tier's stats becomes ``semkv_store_tier_<field>_total{tier=...}``,
plus ``semkv_store_tier_bytes`` / ``semkv_store_tier_entries`` gauges, and the write-behind queue's
counters and ``semkv_store_write_behind_pending_{entries,bytes}`` gauges. Background work that
failed without failing a request (a post-prefill hook, a share index or document record write)
is ``semkv_background_failures_total{what=...}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from semkv.scheduler import StepStats

log = logging.getLogger(__name__)

BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _single(family: CounterMetricFamily | GaugeMetricFamily, value: float) -> Metric:
    """``family`` with its one unlabelled sample."""
    family.add_metric([], float(value))
    return family


class StoreCollector:
    """Reads ``store.stats`` and every tier's ``stats`` / ``nbytes()`` / ``keys()`` when scraped."""

    def __init__(self, store_of: Callable[[], Any]) -> None:
        self.store_of = store_of

    def collect(self) -> Iterator[Metric]:
        store = self.store_of()
        if store is None:
            return
        for name, value in store.stats.as_dict().items():
            yield _single(
                CounterMetricFamily(f"semkv_store_{name}", f"store-level {name} (all tiers)"), value
            )
        fields: dict[str, CounterMetricFamily] = {}
        nbytes = GaugeMetricFamily("semkv_store_tier_bytes", "bytes held by the tier", labels=["tier"])
        entries = GaugeMetricFamily("semkv_store_tier_entries", "entries held by the tier", labels=["tier"])
        for tier in store.tiers:
            for name, value in tier.stats.as_dict().items():
                if name not in fields:
                    fields[name] = CounterMetricFamily(
                        f"semkv_store_tier_{name}", f"tier {name}", labels=["tier"]
                    )
                fields[name].add_metric([tier.name], float(value))
            try:
                nbytes.add_metric([tier.name], float(tier.nbytes()))
                entries.add_metric([tier.name], float(sum(1 for _ in tier.keys())))
            except Exception as exc:  # a scrape must not fail because one tier is sick
                log.warning("cannot size tier %s for metrics: %s", tier.name, exc)
        yield from fields.values()
        yield nbytes
        yield entries
        yield from self._write_behind(store)

    @staticmethod
    def _write_behind(store: Any) -> Iterator[Metric]:
        """``semkv_store_write_behind_<field>_total`` counters and pending gauges of the store's writer."""
        writer = getattr(store, "writer", None)
        if writer is None:
            return
        for name, value in writer.stats.as_dict().items():
            yield _single(
                CounterMetricFamily(f"semkv_store_write_behind_{name}", f"write-behind {name}"), value
            )
        for name, value in (("entries", writer.pending_entries()), ("bytes", writer.pending_bytes())):
            help_text = f"{name} queued for the tiers below memory"
            yield _single(GaugeMetricFamily(f"semkv_store_write_behind_pending_{name}", help_text), value)


class FailureCollector:
    """Reads the counts of background work that failed (``what`` -> count) when scraped."""

    def __init__(self, failures_of: Callable[[], dict[str, int]]) -> None:
        self.failures_of = failures_of

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "semkv_background_failures",
            "post-prefill hooks and index / record writes that failed (the requests were served)",
            labels=["what"],
        )
        for what, count in sorted(self.failures_of().items()):
            family.add_metric([what], float(count))
        yield family


class ServerMetrics:
    def __init__(
        self, store_of: Callable[[], Any], failures_of: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "semkv_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "semkv_request_seconds", "request latency", ["endpoint"], buckets=TIME_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "semkv_ttft_seconds",
            "time to first token: request received (incl. queueing) to first token sampled",
            ["path"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "semkv_prefill_seconds",
            "engine prefill (plan + prefill + sample)",
            ["path"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.reused = Counter(
            "semkv_tokens_reused", "prompt tokens whose KV was reused", ["path"], registry=r
        )
        self.recomputed = Counter(
            "semkv_tokens_recomputed", "prompt tokens computed by the model", ["path"], registry=r
        )
        self.prompt_tokens = Counter("semkv_prompt_tokens", "prompt tokens", registry=r)
        self.completion_tokens = Counter("semkv_completion_tokens", "generated tokens", registry=r)
        self.queue_depth = Gauge("semkv_queue_depth", "requests waiting or running", registry=r)
        self.running = Gauge("semkv_running_sequences", "sequences in the running batch", registry=r)
        self.waiting = Gauge("semkv_waiting_sequences", "requests waiting for admission", registry=r)
        self.live_kv = Gauge(
            "semkv_live_kv_bytes",
            "KV memory held for live sequences after the last step (decode arena with its free slots and"
            " padding, plus caches outside it); the scheduler keeps it within max_live_kv_bytes",
            registry=r,
        )
        self.batch_size = Histogram(
            "semkv_step_batch_size",
            "sequences decoded together in one engine step",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "semkv_step_seconds",
            "engine step time (prefill work + one batched decode)",
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.ended = Counter(
            "semkv_requests_ended",
            "generations ended, by reason: length, eos, stop, abort (client gone), deadline, error",
            ["reason"],
            registry=r,
        )
        self.step_prefills = Counter("semkv_step_prefills", "requests prefilled by engine steps", registry=r)
        self.documents = Counter("semkv_documents_added", "documents uploaded", registry=r)
        self.document_tokens = Counter(
            "semkv_document_tokens_precomputed", "tokens of chunk KV precomputed for documents", registry=r
        )
        r.register(StoreCollector(store_of))
        if failures_of is not None:
            r.register(FailureCollector(failures_of))

    def observe_generation(self, stats: dict[str, Any], completion_tokens: int, ttft_s: float | None) -> None:
        path = str(stats.get("path", "unknown"))
        self.reused.labels(path).inc(float(stats.get("reused_tokens", 0) or 0))
        self.recomputed.labels(path).inc(float(stats.get("recomputed_tokens", 0) or 0))
        self.prompt_tokens.inc(float(stats.get("prompt_tokens", 0) or 0))
        self.completion_tokens.inc(completion_tokens)
        if "ttft_s" in stats:
            self.prefill.labels(path).observe(float(stats["ttft_s"]))
        if ttft_s is not None:
            self.ttft.labels(path).observe(ttft_s)

    def observe_step(self, stats: StepStats, running: int, waiting: int) -> None:
        """One engine step (a :class:`semkv.scheduler.StepStats`) and the scheduler's counts after it."""
        self.batch_size.observe(stats.batch_size)
        self.step_seconds.observe(stats.step_s)
        self.step_prefills.inc(stats.prefilled)
        self.running.set(running)
        self.waiting.set(waiting)
        self.live_kv.set(stats.live_kv_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
