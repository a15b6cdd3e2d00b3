"""Prometheus metrics of one server: a registry of its own, so two servers in one process (tests)
never share counters.

Definitions follow runtime/metrics.py: tau is per request (mean over its target forwards of
accepted + 1), the accepted length is per target forward, the drafting share is drafting time
over decode-loop time. Time to first token runs from the request's arrival, so it includes the
time spent queued behind other requests; time per output token is the decode time after the first
token over the tokens after it (vLLM's TPOT).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specblock.runtime.metrics import DecodeStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # the *_created timestamp series double the page and say nothing here

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


class ServeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specblock_requests", "HTTP requests by endpoint and status (499: client gone)",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specblock_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.completion_tokens = Counter("specblock_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specblock_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("specblock_time_per_output_token_seconds", "Decode time per token after the first",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("specblock_request_seconds", "Arrival to last token", buckets=_LATENCY, registry=r)
        self.tau = Histogram("specblock_tau", "Per request: mean tokens per target forward",
                             buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0), registry=r)
        self.accepted = Histogram("specblock_accepted_length", "Accepted draft tokens per target forward",
                                  buckets=tuple(float(i) for i in range(0, 11)) + (12.0, 16.0), registry=r)
        self.draft_share = Histogram("specblock_draft_share", "Per request: drafting time / decode-loop time",
                                     buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0), registry=r)
        self.queue_depth = Gauge("specblock_queue_depth", "Requests waiting for the engine (the running one "
                                 "excluded)", registry=r)
        self.running = Gauge("specblock_running", "Requests on the engine now (0 or 1)", registry=r)
        self.adapt_updates = Counter("specblock_adapt_updates", "Drafter weight updates swapped in (--adapt)",
                                     registry=r)
        self.adapt_rollbacks = Counter("specblock_adapt_rollbacks", "Rollbacks to the last good drafter (--adapt)",
                                       registry=r)
        self._adapt_seen = (0, 0)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def served(self, prompt_tokens: int, completion_tokens: int, stats: DecodeStats,
               ttft: float | None, tpot: float | None, e2e: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(e2e)
        if stats.iterations:
            self.tau.observe(stats.tau)
            self.draft_share.observe(stats.draft_share)
            for a in stats.accepted:  # one per target forward, a few dozen per request at most
                self.accepted.observe(a)

    def adaptation(self, summary: dict) -> None:
        """Counters from the adapter's running totals (it counts; we only export the increments)."""
        swaps, rollbacks = int(summary.get("adapt_swaps", 0)), int(summary.get("adapt_rollbacks", 0))
        seen_s, seen_r = self._adapt_seen
        if swaps > seen_s:
            self.adapt_updates.inc(swaps - seen_s)
        if rollbacks > seen_r:
            self.adapt_rollbacks.inc(rollbacks - seen_r)
        self._adapt_seen = (max(swaps, seen_s), max(rollbacks, seen_r))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
