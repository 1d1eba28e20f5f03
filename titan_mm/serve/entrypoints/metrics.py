"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own.

Per request, when it finishes (histograms; ``histogram_quantile`` over the buckets gives the p50 / p90 / p99,
since prometheus-client's Summary has no quantiles):
    titan_mm_serve_queue_seconds        arrival -> first scheduled
    titan_mm_serve_prefill_seconds      first scheduled -> first token
    titan_mm_serve_decode_seconds       first token -> last token
    titan_mm_serve_postprocess_seconds  the server's own time on the request's outputs (detokenized deltas,
                                        JSON, SSE framing)
    titan_mm_serve_ttft_seconds         arrival -> first token
    titan_mm_serve_tpot_seconds         decode seconds / (generated tokens - 1), requests with >= 2 tokens
    titan_mm_serve_e2e_seconds          arrival -> finished
Counters: requests by finish reason (stop, length, abort; one count per choice, so n per request), prompt and
generated tokens, HTTP errors by status (400, 404, 429, 500). From ``engine.stats()`` at scrape time: KV blocks
used / total and usage, prefix-cache hit rate, running and waiting requests (gauges); preemptions and evictions
(counters).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "titan_mm_serve_"
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# engine.stats() key -> (metric name, help, kind)
ENGINE_STATS = {
    "kv_blocks_used": ("kv_blocks_used", "KV-cache blocks held by requests", "gauge"),
    "kv_blocks_total": ("kv_blocks_total", "KV-cache blocks in the pool", "gauge"),
    "kv_usage": ("kv_usage", "fraction of the KV-cache pool held by requests", "gauge"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens",
                              "gauge"),
    "num_running": ("running_requests", "requests being prefilled or decoded", "gauge"),
    "num_waiting": ("waiting_requests", "requests queued for admission", "gauge"),
    "num_preemptions": ("preemptions", "requests preempted (recomputed later) when blocks ran out", "counter"),
    "num_evictions": ("evictions", "cached prefix blocks evicted (LRU) to make room", "counter"),
}


class _EngineCollector:
    """Reads ``stats()`` at scrape time, so the numbers are the engine's own and never go stale."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        for key, (name, doc, kind) in ENGINE_STATS.items():
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(PREFIX + name, doc)
            fam.add_metric([], float(s[key]))
            yield fam


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry

        def hist(name, doc, buckets=SECONDS):
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.queue = hist("queue_seconds", "arrival to first scheduled")
        self.prefill = hist("prefill_seconds", "first scheduled to first token")
        self.decode = hist("decode_seconds", "first token to last token")
        self.postprocess = hist("postprocess_seconds", "server time on the request's outputs (detokenize, JSON)")
        self.ttft = hist("ttft_seconds", "time to first token")
        self.tpot = hist("tpot_seconds", "time per output token after the first", PER_TOKEN)
        self.e2e = hist("e2e_seconds", "arrival to finished")
        self.requests = Counter(PREFIX + "requests", "finished outputs (one per choice) by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(PREFIX + "generation_tokens", "tokens generated", registry=r)
        self.http_errors = Counter(PREFIX + "http_errors", "error answers by HTTP status", ["status"], registry=r)
        r.register(_EngineCollector(engine_stats))

    def finished(self, out, postprocess_s: float) -> None:
        """Record a finished ``RequestOutput``."""
        m = out.metrics
        for c in out.outputs:
            self.requests.labels(c.finish_reason or "abort").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generated_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        self.postprocess.observe(postprocess_s)
        if m.queue_s is not None:
            self.queue.observe(m.queue_s)
        if m.first_token is None:  # aborted or dropped before its first token
            return
        self.prefill.observe(m.prefill_s)
        self.decode.observe(m.decode_s)
        self.ttft.observe(m.first_token - m.arrival)
        self.e2e.observe(m.finished - m.arrival)
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        if longest >= 2:
            self.tpot.observe(m.decode_s / (longest - 1))

    def aborted(self, n: int) -> None:
        """``n`` outputs (choices) aborted because their client went away (the engine sends them no final
        output)."""
        if n:
            self.requests.labels("abort").inc(n)

    def error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
