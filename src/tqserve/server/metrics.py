"""Prometheus metrics with vLLM's names under the `tqserve:` prefix.

Each app owns a CollectorRegistry so several servers can live in one process (tests). The engine
thread writes the metrics; prometheus_client's metric objects are thread-safe.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tqserve:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(f"tqserve:{name}", doc, labels + (extra or []), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tqserve:{name}", doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV pages in use (0..1).")
        self.num_free_blocks = gauge("num_free_blocks", "KV pages free to hand out.")
        self.num_total_blocks = gauge("num_total_blocks", "KV pages in the pool.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted to free KV pages.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.num_requests_aborted = counter("num_requests_aborted", "Requests aborted (client gone or error).")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between generated tokens.", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_BUCKETS
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduling to first token.", _REQUEST_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS
        )
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt length per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens produced per engine step.", _TOKEN_BUCKETS)
        self._label = model_name
        # The engine reports cumulative totals; counters take increments.
        self._last_totals: dict[str, int] = {}
        self._create_samples()

    def _labelled(self) -> list:
        return [v for v in vars(self).values() if isinstance(v, (Gauge, Counter, Histogram))]

    def _create_samples(self) -> None:
        # A labelled metric has no sample until its child exists: create them so a scrape sees every
        # metric at zero from the start.
        for metric in self._labelled():
            if metric is self.request_success:
                for reason in ("stop", "length"):
                    metric.labels(model_name=self._label, finished_reason=reason)
            else:
                metric.labels(model_name=self._label)

    def set_model_name(self, name: str) -> None:
        """The label value, once the engine has said which model it serves (before any sample)."""
        if name == self._label:
            return
        for metric in self._labelled():
            if metric is self.request_success:
                for reason in ("stop", "length"):
                    metric.remove(self._label, reason)
            else:
                metric.remove(self._label)
        self._label = name
        self._create_samples()

    def count_success(self, finished_reason: str) -> None:
        self.request_success.labels(model_name=self._label, finished_reason=finished_reason).inc()

    def label(self, metric):
        return metric.labels(model_name=self._label)

    def update_from_stats(self, stats: dict) -> None:
        """Gauges and cumulative counters from `engine.get_stats()`; missing keys are skipped."""
        for key, gauge in (
            ("num_running", self.num_requests_running),
            ("num_waiting", self.num_requests_waiting),
            ("kv_cache_usage", self.kv_cache_usage_perc),
            ("num_free_blocks", self.num_free_blocks),
            ("num_total_blocks", self.num_total_blocks),
        ):
            if key in stats and stats[key] is not None:
                self.label(gauge).set(float(stats[key]))
        for key, counter in (
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
            ("num_preemptions", self.num_preemptions),
        ):
            if key not in stats or stats[key] is None:
                continue
            total = int(stats[key])
            delta = total - self._last_totals.get(key, 0)
            if delta > 0:
                self.label(counter).inc(delta)
            self._last_totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
