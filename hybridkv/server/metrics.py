"""The server's Prometheus metrics (``GET /metrics``) and its periodic stats log line.

Engine state (requests running and waiting, KV-cache usage per group, prefix-cache lookups and hits per group,
preemptions, steps, tokens computed) is read at a step boundary when scraped (``AsyncLLM.snapshot``) and
exported as gauges and counters; request latencies are observed by the request handlers: time to first token,
end-to-end and queue time and time per output token when a request finishes, inter-token latency per
streamed delta (as the handler receives it: what a streaming client sees). Names follow vLLM's with the
``hybridkv:`` prefix. Each app has its own registry (several servers may share a process). With several API
processes (``--api-server-count``), prometheus-client's multiprocess mode keeps each process's request metrics
in files of ``PROMETHEUS_MULTIPROC_DIR`` and a scrape of any process adds them all up.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hybridkv.engine.async_llm import RequestStream
from hybridkv.engine.engine import STEP_SECONDS_BUCKETS
from hybridkv.engine.front import EngineSnapshot
from hybridkv.envs import prometheus_multiproc_dir

logger = logging.getLogger("hybridkv.server")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (*STEP_SECONDS_BUCKETS[:-3], 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)   # 0.25 ms apart to 10 ms


class _EngineCollector:
    """Exports the latest ``EngineSnapshot`` (refreshed by the scrape handler before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield GaugeMetricFamily("hybridkv:num_requests_running", "Requests in the running batch.", value=s.running)
        yield GaugeMetricFamily("hybridkv:num_requests_waiting", "Requests waiting to be scheduled.",
                                value=s.waiting)
        usage = GaugeMetricFamily("hybridkv:kv_cache_usage_perc", "Share of a KV-cache group's pool in use "
                                  "(blocks for attention groups, state slots for Mamba groups), 0-1.",
                                  labels=["group", "kind"])
        queries = CounterMetricFamily("hybridkv:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache, per group.", labels=["group", "kind"])
        hits = CounterMetricFamily("hybridkv:prefix_cache_hits", "Prompt tokens found in the prefix cache, per "
                                   "group.", labels=["group", "kind"])
        for gid, kind in s.group_kinds.items():
            labels = [str(gid), kind]
            usage.add_metric(labels, s.kv_usage.get(gid, 0.0))
            queries.add_metric(labels, s.prefix_queries.get(gid, 0))
            hits.add_metric(labels, s.prefix_hits.get(gid, 0))
        yield usage
        yield queries
        yield hits
        yield CounterMetricFamily("hybridkv:num_preemptions", "Requests preempted (to be recomputed).",
                                  value=s.preemptions)
        yield CounterMetricFamily("hybridkv:engine_steps", "Engine steps run.", value=s.steps)
        yield HistogramMetricFamily(
            "hybridkv:engine_step_seconds", "Time from one engine step's start to the next's while the engine "
            "stays busy: the engine's share of the inter-token latency.",
            buckets=[*zip(map(str, (*STEP_SECONDS_BUCKETS, "+Inf")), itertools.accumulate(s.step_seconds),
                          strict=True)],
            sum_value=s.step_seconds_sum)
        yield CounterMetricFamily("hybridkv:prompt_tokens_computed", "Prompt tokens computed by the model "
                                  "(recomputation after preemption included, prefix-cache hits excluded).",
                                  value=s.prompt_tokens)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector()
        self.registry.register(self.engine)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("hybridkv:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("hybridkv:generation_tokens", "Tokens generated for finished requests.",
                                         labels, registry=r).labels(model_name)
        self._finished = Counter("hybridkv:request_success", "Requests finished, by reason.",
                                 [*labels, "finished_reason"], registry=r)
        self.aborted = Counter("hybridkv:request_aborted", "Requests aborted before finishing (client gone, "
                               "server shutting down).", labels, registry=r).labels(model_name)
        self.rejected = Counter("hybridkv:request_rejected", "Requests refused before running, by HTTP status.",
                                [*labels, "status"], registry=r)
        self.ttft = Histogram("hybridkv:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("hybridkv:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("hybridkv:request_queue_time_seconds", "Time from arrival to first scheduled.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("hybridkv:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", labels, buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("hybridkv:inter_token_latency_seconds", "Time between streamed tokens.", labels,
                             buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self._model_name = model_name
        self._exported = r
        shared = prometheus_multiproc_dir()
        if shared is not None:                  # every API process's request metrics, and this engine's state
            from prometheus_client.multiprocess import MultiProcessCollector

            self._exported = CollectorRegistry()
            MultiProcessCollector(self._exported, path=shared)
            self._exported.register(self.engine)

    def finished(self, stream: RequestStream) -> None:
        """A request whose samples all finished."""
        self.prompt_tokens.inc(len(stream.prompt_token_ids))
        self.generation_tokens.inc(stream.num_output_tokens)
        for reason in stream.finish_reasons.values():
            self._finished.labels(self._model_name, reason or "unknown").inc()
        for m in stream.metrics.values():
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
        per_sample = stream.num_output_tokens / max(len(stream.metrics), 1)
        for m in stream.metrics.values():
            if m.first_token_time is not None and m.last_token_time is not None and per_sample > 1:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (per_sample - 1))

    def reject(self, status: int) -> None:
        self.rejected.labels(self._model_name, str(status)).inc()

    def render(self, snapshot: EngineSnapshot | None) -> bytes:
        if snapshot is not None:
            self.engine.snapshot = snapshot
        return generate_latest(self._exported)


class TokenTimer:
    """Inter-token latency of one streamed request: the time between deltas, spread over their tokens."""

    __slots__ = ("_histogram", "_last")

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        now = time.monotonic()
        if self._last is not None and count:
            gap = (now - self._last) / count
            for _ in range(count):
                self._histogram.observe(gap)
        if count:
            self._last = now


class StatsLog:
    """vLLM's periodic engine line: running / waiting requests, prompt and generation throughput since the
    last line, KV usage per group, prefix-cache hit rate. Quiet while nothing happens."""

    def __init__(self) -> None:
        self._last: tuple[float, EngineSnapshot] | None = None
        self._was_busy = False

    def line(self, snapshot: EngineSnapshot, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, snapshot)
        if last is None:
            return None
        then, prev = last
        seconds = max(now - then, 1e-9)
        prompt = (snapshot.prompt_tokens - prev.prompt_tokens) / seconds
        generated = (snapshot.generated_tokens - prev.generated_tokens) / seconds
        busy = bool(snapshot.running or snapshot.waiting or prompt or generated)
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        kv = ", ".join(f"{gid} {kind} {100 * snapshot.kv_usage.get(gid, 0.0):.1f}%"
                       for gid, kind in snapshot.group_kinds.items())
        queried = snapshot.prefix_query_tokens - prev.prefix_query_tokens
        hit = snapshot.prefix_hit_tokens - prev.prefix_hit_tokens
        rate = f"{100 * hit / queried:.1f}%" if queried else "-"
        return (f"Running: {snapshot.running} reqs, Waiting: {snapshot.waiting} reqs, Avg prompt throughput: "
                f"{prompt:.1f} tokens/s, Avg generation throughput: {generated:.1f} tokens/s, KV usage (group kind): "
                f"{kv}, Prefix cache hit rate: {rate}, Preemptions: {snapshot.preemptions}")
