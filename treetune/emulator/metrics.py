"""SGLang's Prometheus metrics (names from SGLang 0.5.23), kept with prometheus-client, and
the emulator's own clock lag (named by its backend: SGLang has no such metric)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from treetune.backends.emulator import CLOCK_LAG_METRIC

disable_created_metrics()  # SGLang exposes no *_created series

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)


# SGLang's metrics_collector.py first has sglang:spec_verify_calls_total in 0.5.13 (the
# wheels'): an older server's accept length over a window cannot be counted.
VERIFY_COUNTER_SINCE = (0, 5, 13)


class ServerMetrics:
    def __init__(self, model_name: str, counts_verify_calls: bool = True) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, labels, registry=r)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"sglang:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=r)

        self._running = gauge("num_running_reqs", "Running requests.").labels(model_name)
        self._queue = gauge("num_queue_reqs", "Queued requests.").labels(model_name)
        self._usage = gauge("token_usage", "KV-cache token usage (0-1).").labels(model_name)
        self._throughput = gauge("gen_throughput", "Generation throughput (tokens/s).").labels(
            model_name)
        self._accept_length = gauge("spec_accept_length", "Average accept length.").labels(
            model_name)
        self._accept_rate = gauge("spec_accept_rate", "Accepted share of drafted steps.").labels(
            model_name)
        # SGLang's counters have no series until their first count (only their HELP and
        # TYPE lines): a reader must take a missing series as none counted yet.
        self._model_name = model_name
        self._verify = counter("spec_verify_calls", "Speculative verify calls.") \
            if counts_verify_calls else None
        self._generation = counter("generation_tokens", "Generated tokens.")
        self._prompt = counter("prompt_tokens", "Prefilled prompt tokens.")
        self._ttft = hist("time_to_first_token_seconds", "Time to first token.").labels(model_name)
        self._itl = hist("inter_token_latency_seconds", "Inter-token latency.").labels(model_name)
        self._e2e = hist("e2e_request_latency_seconds", "End-to-end latency.").labels(model_name)
        self._clock_lag = Histogram(
            CLOCK_LAG_METRIC, "Emulated seconds each emulated deadline was met late.", labels,
            buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def queue(self, n: int) -> None:
        self._queue.set(n)

    def running(self, n: int, token_usage: float) -> None:
        """The running requests changed (admitted, finished, cancelled): the gauges that
        follow them."""
        self._running.set(n)
        self._usage.set(token_usage)

    def finished(self, prompt_tokens: int, generated: int, verify_calls: int) -> None:
        """One request ended (finished or aborted): its counts, as SGLang adds them."""
        self._prompt.labels(self._model_name).inc(prompt_tokens)
        self._generation.labels(self._model_name).inc(generated)
        if verify_calls and self._verify is not None:
            self._verify.labels(self._model_name).inc(verify_calls)

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def clock_lag(self, seconds: float) -> None:
        self._clock_lag.observe(seconds)

    def round(
        self,
        *,
        running: int,
        gen_throughput: float,
        accept_length: float | None,
        steps: int | None,
        token_usage: float,
    ) -> None:
        self._running.set(running)
        self._throughput.set(gen_throughput)
        self._usage.set(token_usage)
        if accept_length is not None and steps:
            self._accept_length.set(accept_length)
            self._accept_rate.set((accept_length - 1.0) / steps)
