"""`/metrics`: the server's counters in Prometheus text format, through `prometheus_client`
(the reference implementation of the format; one registry per server, so two servers in one
process, as in the tests, count apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TAU_BUCKETS = tuple(float(b) for b in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32))
SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, worker, pool):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "dflash_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens.", registry=r)
        self.cached_tokens = Counter(
            "dflash_cached_prompt_tokens", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.completion_tokens = Counter(
            "dflash_completion_tokens", "Generated tokens.", registry=r
        )
        self.prefix_hits = Counter(
            "dflash_prefix_cache_hits", "Generations that reused a cached prefix.", registry=r
        )
        self.prefill = Histogram(
            "dflash_prefill_seconds", "Prefill time per generation.", buckets=SECONDS, registry=r
        )
        self.decode = Histogram(
            "dflash_decode_seconds", "Decode time per generation.", buckets=SECONDS, registry=r
        )
        self.tau = Histogram(
            "dflash_acceptance_length",
            "Tokens per decoding round (tau: accepted drafts plus the bonus token).",
            buckets=TAU_BUCKETS,
            registry=r,
        )
        self.rounds = Counter(
            "dflash_rounds", "Decoding rounds, drafted or plain.", ["kind"], registry=r
        )
        self.finishes = Counter(
            "dflash_generations", "Generations by how they ended.", ["finish"], registry=r
        )
        Gauge("dflash_queue_depth", "Requests waiting for the model.", registry=r).set_function(
            lambda: worker.waiting
        )
        Gauge("dflash_busy", "1 while a generation runs.", registry=r).set_function(
            lambda: float(worker.busy)
        )
        Gauge(
            "dflash_cached_sessions", "Sessions idle in the prefix cache.", registry=r
        ).set_function(lambda: len(pool.idle))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def generation(self, done) -> None:
        """One finished generation (a worker Done)."""
        self.prompt_tokens.inc(done.prompt_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        self.completion_tokens.inc(done.completion_tokens)
        self.prefix_hits.inc(done.cached_tokens > 0)
        s = done.stats
        self.prefill.observe(s.get("time_prefill_s", 0.0))
        self.decode.observe(s.get("time_decode_s", 0.0))
        for tau, n in s.get("tau_histogram", {}).items():
            for _ in range(n):
                self.tau.observe(int(tau))
        drafted = s.get("draft_rounds", 0)
        self.rounds.labels("drafted").inc(drafted)
        self.rounds.labels("plain").inc(max(s.get("rounds", 0) - drafted, 0))
        self.finishes.labels(done.finish).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
