"""The server's Prometheus metrics, in a registry of its own.

The speculative counters take vLLM's names under specedge's prefix
(`specedge_spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}`), so the
acceptance rate is accepted / draft tokens and the mean accepted length is
1 + accepted / drafts, as on vLLM's dashboards.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
BATCH_ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


def generation_counts(stats: dict, prompt_tokens: int) -> dict[str, int]:
    """What one finished generation (its statistics, runtime/stats.py) adds to each counter,
    by the counter's attribute name: the server's registry and the cluster replicas' Ray
    metrics count from the same figures."""
    tries = stats["position_tries"]
    return {"prompt_tokens": prompt_tokens, "generation_tokens": stats["tokens_generated"],
            "target_calls": stats["target_calls"] + 1,  # + the prefill call
            "num_drafts": tries[0] if tries else 0, "draft_tokens": stats["drafted_tokens"],
            "accepted_tokens": stats["accepted_tokens"]}


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specedge_requests", "HTTP requests by endpoint and status "
                                "(499: the client went away)", ["endpoint", "status"],
                                registry=r)
        self.queue_depth = Gauge("specedge_queue_depth", "requests waiting for the generator",
                                 registry=r)
        self.running = Gauge("specedge_requests_running", "requests being generated (at "
                             "most --max-batch)", registry=r)
        self.batch_rows = Histogram("specedge_batch_rows", "sequences carried by each "
                                    "batched target call (--max-batch > 1)",
                                    buckets=BATCH_ROWS_BUCKETS, registry=r)
        self.ttft = Histogram("specedge_time_to_first_token_seconds", "arrival to first "
                              "text", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specedge_inter_token_latency_seconds", "decoding time per "
                             "generated token after the first (each request's mean, once "
                             "per token)", buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("specedge_request_latency_seconds", "arrival to the last "
                                 "token", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specedge_prompt_tokens", "prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("specedge_generation_tokens", "tokens generated",
                                         registry=r)
        self.target_calls = Counter("specedge_target_calls", "target model calls "
                                    "(prefill and verification)", registry=r)
        self.num_drafts = Counter("specedge_spec_decode_num_drafts", "steps that drafted",
                                  registry=r)
        self.draft_tokens = Counter("specedge_spec_decode_num_draft_tokens", "tokens "
                                    "drafted", registry=r)
        self.accepted_tokens = Counter("specedge_spec_decode_num_accepted_tokens", "draft "
                                       "tokens accepted", registry=r)
        self.accepted_per_pos = Counter("specedge_spec_decode_num_accepted_tokens_per_pos",
                                        "draft tokens accepted at each draft position",
                                        ["position"], registry=r)

    def batch_call(self, rows: int) -> None:
        """One target call that carried `rows` sequences (--max-batch > 1)."""
        self.batch_rows.observe(rows)

    def queue_changed(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def generation(self, stats: dict, prompt_tokens: int, seconds: float) -> None:
        """Count one finished generation from its statistics (runtime/stats.py)."""
        for name, count in generation_counts(stats, prompt_tokens).items():
            getattr(self, name).inc(count)
        for position, accepted in enumerate(stats["position_accepts"]):
            self.accepted_per_pos.labels(position=str(position)).inc(accepted)
        self.latency.observe(seconds)
        decoded = stats["tokens_generated"] - 1
        decode_seconds = stats["time_total_s"] - stats["time_prefill_s"]
        if decoded > 0:
            for _ in range(decoded):
                self.itl.observe(decode_seconds / decoded)
