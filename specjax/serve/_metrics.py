"""The server's Prometheus counters and histograms, with vLLM's names, in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


# Latency buckets in seconds (vLLM's request-latency buckets, shortened at both ends for small models).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """The counters /metrics exposes, labelled with the served model's name as vLLM labels them."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative steps (drafts verified).", labels,
                                  registry=registry)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels,
                                        registry=registry)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                           registry=registry)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", [*labels, "position"],
                                        registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=registry)
        self.request_success = Counter("vllm:request_success", "Requests that ended, by why.",
                                       [*labels, "finished_reason"], registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests being served now.", labels, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=registry)
        # Series labelled by the model alone are exposed from the start, at 0, so that a scrape sees them all.
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.prompt_tokens,
                       self.generation_tokens, self.running, self.e2e, self.ttft):
            metric.labels(model_name)

    def observe(self, output, prompt_tokens: int) -> None:
        """Counts one ended request (an engine RequestOutput)."""
        name = self.model_name
        self.request_success.labels(name, output.finish_reason).inc()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(len(output.tokens))
        if output.finish_time is not None:
            self.e2e.labels(name).observe(output.finish_time - output.arrival_time)
        if output.ttft is not None:
            self.ttft.labels(name).observe(output.ttft)
        metrics = output.metrics
        if metrics is None:
            return
        self.num_drafts.labels(name).inc(metrics["steps"])
        self.num_draft_tokens.labels(name).inc(metrics["drafted"])
        self.num_accepted_tokens.labels(name).inc(metrics["accepted"])
        # Position i (0-based) was accepted at every step that accepted more than i drafts.
        histogram = metrics["length_histogram"]
        for position in range(len(histogram) - 1):
            self.accepted_per_pos.labels(name, str(position)).inc(sum(histogram[position + 1:]))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
