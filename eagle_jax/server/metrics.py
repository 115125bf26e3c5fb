"""Prometheus metrics of the server, under vLLM's metric names.

``vllm bench serve`` and Grafana dashboards built for vLLM read these names, so they are
kept exactly: counters ``vllm:spec_decode_num_drafts`` / ``_num_draft_tokens`` /
``_num_accepted_tokens`` / ``_num_accepted_tokens_per_pos{position}``,
``vllm:request_success{finished_reason}``, ``vllm:prompt_tokens``,
``vllm:generation_tokens``; gauges ``vllm:num_requests_running`` / ``_waiting``;
histograms ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:time_per_output_token_seconds``, ``vllm:request_queue_time_seconds``. Every
metric carries ``model_name``.

eagle_jax's own, for the adaptive draft length (no vLLM equivalent): the histogram
``eagle_jax:spec_decode_draft_length`` (one observation per engine step: the tokens it
drafted, 0 for the target's step alone) and the counters
``eagle_jax:spec_decode_forecast_tokens`` / ``_forecast_seconds`` (what the policy
expected of its steps: committed tokens and step time), whose rates' ratio is the
goodput forecast to hold against ``rate(vllm:generation_tokens)``; the gauges
``eagle_jax:executables_compiled`` / ``eagle_jax:executables_pending`` (compiled so far,
and still compiling in the background while the server answers: the start-up backlog).
(prometheus_client appends ``_total`` to counter samples, as it does for vLLM.)

Each ``ServerMetrics`` owns a private ``CollectorRegistry``, so several apps can live in
one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.types import CompileProgress, SchedulerStats, SpecDecodeStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets.
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
_TPOT_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]


_DRAFT_LENGTH_BUCKETS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16]


class ServerMetrics:
    """The server's Prometheus collectors, bound to one served model name."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.spec_num_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", m, registry=r
        )
        self.spec_num_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", m, registry=r
        )
        self.spec_num_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", m, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position (for a draft tree, depth - 1).",
            m + ["position"],
            registry=r,
        )
        self.spec_draft_length = Histogram(
            "eagle_jax:spec_decode_draft_length",
            "Draft tokens proposed per engine step (0: the target's step alone).", m,
            buckets=_DRAFT_LENGTH_BUCKETS, registry=r,
        )
        self.spec_forecast_tokens = Counter(
            "eagle_jax:spec_decode_forecast_tokens",
            "Committed tokens the adaptive draft-length policy expected of its steps.", m,
            registry=r,
        )
        self.spec_forecast_seconds = Counter(
            "eagle_jax:spec_decode_forecast_seconds",
            "Step time the adaptive draft-length policy expected of its steps.", m,
            registry=r,
        )
        self.num_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", m,
            registry=r, multiprocess_mode="sum",
        )
        self.num_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", m,
            registry=r, multiprocess_mode="sum",
        )
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m,
            registry=r, multiprocess_mode="sum",
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine.", m,
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.", m, registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.", m, registry=r,
        )
        self.request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            m + ["finished_reason"], registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            m, buckets=_TTFT_BUCKETS, registry=r,
        )
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            m, buckets=_TPOT_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in the waiting queue in seconds.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.executables_compiled = Gauge(
            "eagle_jax:executables_compiled", "Executables the engine has compiled.", m,
            registry=r, multiprocess_mode="sum",
        )
        self.executables_pending = Gauge(
            "eagle_jax:executables_pending",
            "Executables still compiling in the background (the server answers meanwhile "
            "from the compiled ones).", m, registry=r, multiprocess_mode="sum",
        )
        n = model_name
        # Create the label children so that every metric shows up (at 0) from the start.
        self._drafts = self.spec_num_drafts.labels(n)
        self._draft_tokens = self.spec_num_draft_tokens.labels(n)
        self._accepted = self.spec_num_accepted_tokens.labels(n)
        self._draft_length = self.spec_draft_length.labels(n)
        self._forecast_tokens = self.spec_forecast_tokens.labels(n)
        self._forecast_seconds = self.spec_forecast_seconds.labels(n)
        self._running = self.num_running.labels(n)
        self._waiting = self.num_waiting.labels(n)
        self._kv_usage = self.kv_cache_usage.labels(n)
        self._preemptions = self.num_preemptions.labels(n)
        self._last_preemptions = 0
        self._prefix_queries = self.prefix_cache_queries.labels(n)
        self._prefix_hits = self.prefix_cache_hits.labels(n)
        self._last_prefix = (0, 0)
        self._prompt_tokens = self.prompt_tokens.labels(n)
        self._generation_tokens = self.generation_tokens.labels(n)
        self._ttft = self.ttft.labels(n)
        self._e2e = self.e2e_latency.labels(n)
        self._tpot = self.tpot.labels(n)
        self._queue = self.queue_time.labels(n)
        self._compiled = self.executables_compiled.labels(n)
        self._pending = self.executables_pending.labels(n)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(n, reason)
        self._last_stats = SpecDecodeStats()

    # ----------------------------------------------------------------- updates
    def update_spec_decode(self, stats: SpecDecodeStats) -> None:
        """Adds the difference between ``stats`` (cumulative) and the last call's."""
        last = self._last_stats
        d = stats.num_drafts - last.num_drafts
        if d > 0:
            self._drafts.inc(d)
        d = stats.num_draft_tokens - last.num_draft_tokens
        if d > 0:
            self._draft_tokens.inc(d)
        d = stats.num_accepted_tokens - last.num_accepted_tokens
        if d > 0:
            self._accepted.inc(d)
        per_pos = list(stats.accepted_per_pos)
        for pos, value in enumerate(per_pos):
            prev = last.accepted_per_pos[pos] if pos < len(last.accepted_per_pos) else 0
            child = self.spec_accepted_per_pos.labels(self.model_name, str(pos))
            if value - prev > 0:
                child.inc(value - prev)
        for length, steps in enumerate(stats.draft_length_steps):
            prev = (last.draft_length_steps[length]
                    if length < len(last.draft_length_steps) else 0)
            for _ in range(steps - prev):
                self._draft_length.observe(length)
        self._forecast_tokens.inc(max(stats.forecast_tokens - last.forecast_tokens, 0.0))
        self._forecast_seconds.inc(max(stats.forecast_seconds - last.forecast_seconds, 0.0))
        self._last_stats = SpecDecodeStats(
            num_drafts=stats.num_drafts,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            accepted_per_pos=per_pos,
            draft_length_steps=list(stats.draft_length_steps),
            forecast_tokens=stats.forecast_tokens,
            forecast_seconds=stats.forecast_seconds,
        )

    def update_scheduler(self, stats: SchedulerStats) -> None:
        """Queue sizes and KV usage now; preemptions and prefix-cache queries and hits
        since the last call."""
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions > self._last_preemptions:
            self._preemptions.inc(stats.num_preemptions - self._last_preemptions)
        self._last_preemptions = stats.num_preemptions
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self._prefix_queries.inc(max(queries - self._last_prefix[0], 0))
        self._prefix_hits.inc(max(hits - self._last_prefix[1], 0))
        self._last_prefix = (queries, hits)

    def update_compile_progress(self, progress: CompileProgress) -> None:
        self._compiled.set(progress.compiled)
        self._pending.set(progress.pending)

    def add_prompt_tokens(self, n: int) -> None:
        if n > 0:
            self._prompt_tokens.inc(n)

    def add_generation_tokens(self, n: int) -> None:
        if n > 0:
            self._generation_tokens.inc(n)

    def observe_first_token(self, ttft: float, queue_time: float) -> None:
        self._ttft.observe(max(ttft, 0.0))
        self._queue.observe(max(queue_time, 0.0))

    def observe_finished(
        self, reason: str, e2e: float, ttft: float | None, num_output_tokens: int
    ) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self._e2e.observe(max(e2e, 0.0))
        if ttft is not None and num_output_tokens > 1:
            self._tpot.observe(max((e2e - ttft) / (num_output_tokens - 1), 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
