"""Prometheus metrics of one server, in a registry of its own (several servers can share a
process, e.g. in tests). Names follow SGLang's `sglang:` metrics where SGLang has one.

The HTTP layer observes per-request values (`observe_*`); gauges of scheduler state, DSpark
acceptance included, are refreshed from the latest `SchedulerStats` when `/metrics` is scraped.
The DSpark gauges exist only when speculative decoding is on.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sgl_dspark.srt.managers.io_struct import SchedulerStats

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    8.0,
    16.0,
    32.0,
    64.0,
)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)


class ServerMetrics:
    """Collectors of one server. `spec_positions` > 0 adds the DSpark acceptance gauges."""

    def __init__(self, model_name: str, spec_positions: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        labels = {"model_name": model_name}
        self._labels = labels
        self.num_requests = Counter(
            "sglang:num_requests",
            "HTTP generation requests by endpoint and status code",
            ["model_name", "endpoint", "code"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens",
            "Prompt tokens of finished requests",
            ["model_name"],
            registry=reg,
        ).labels(**labels)
        self.generation_tokens = Counter(
            "sglang:generation_tokens",
            "Output tokens of finished requests",
            ["model_name"],
            registry=reg,
        ).labels(**labels)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Arrival to first output token",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        ).labels(**labels)
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Time between output tokens (a chunk's gap over its tokens)",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        ).labels(**labels)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Arrival to last output token",
            ["model_name"],
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(**labels)
        self.running = self._gauge("sglang:num_running_reqs", "Requests in the running batch")
        self.queued = self._gauge("sglang:num_queue_reqs", "Requests waiting for admission")
        self.token_usage = self._gauge("sglang:token_usage", "Fraction of KV pages in use")
        self.kv_free_pages = self._gauge("sglang:kv_free_pages", "Free KV pages")
        self.kv_total_pages = self._gauge("sglang:kv_total_pages", "Usable KV pages")
        self.spec_accept_length: Gauge | None = None
        if spec_positions > 0:
            self.spec_accept_length = self._gauge(
                "sglang:spec_accept_length", "DSpark mean tokens committed per request-step"
            )
            self.spec_accept_rate = self._gauge(
                "sglang:spec_accept_rate", "DSpark correct drafts / verified drafts"
            )
            self.spec_position_acceptance = Gauge(
                "sglang:spec_accept_rate_by_position",
                "DSpark conditional acceptance of draft position k given k-1 accepted",
                ["model_name", "position"],
                registry=reg,
            )
            self._spec_positions = spec_positions

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(**self._labels)

    # ---- observations ----------------------------------------------------------------------------
    def count_request(self, endpoint: str, code: int) -> None:
        self.num_requests.labels(endpoint=endpoint, code=str(code), **self._labels).inc()

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_chunk(self, gap_seconds: float, num_tokens: int) -> None:
        """A streamed chunk of `num_tokens` tokens arrived `gap_seconds` after the previous one."""
        if num_tokens > 0:
            per_token = gap_seconds / num_tokens
            for _ in range(num_tokens):
                self.itl.observe(per_token)

    def observe_finished(
        self, prompt_tokens: int, completion_tokens: int, e2e_seconds: float
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e_seconds)

    def record_spec(
        self,
        accept_length: float,
        accept_rate: float,
        conditional_acceptance: Sequence[float | None],
    ) -> None:
        """Set the DSpark gauges; positions without data are left unset."""
        assert self.spec_accept_length is not None, "server metrics built without DSpark"
        self.spec_accept_length.set(accept_length)
        self.spec_accept_rate.set(accept_rate)
        for k, value in enumerate(conditional_acceptance[: self._spec_positions], start=1):
            if value is not None:
                self.spec_position_acceptance.labels(position=str(k), **self._labels).set(value)

    def render(self, stats: SchedulerStats) -> bytes:
        """Exposition-format text, with the scheduler gauges refreshed from `stats`."""
        self.running.set(stats.num_running_reqs)
        self.queued.set(stats.num_waiting_reqs)
        self.token_usage.set(stats.token_usage)
        self.kv_free_pages.set(stats.kv_free_pages)
        self.kv_total_pages.set(stats.kv_total_pages)
        if self.spec_accept_length is not None and stats.spec_accept_length is not None:
            self.record_spec(
                stats.spec_accept_length,
                stats.spec_accept_rate or 0.0,
                stats.spec_acceptance_by_position,
            )
        return generate_latest(self.registry)
