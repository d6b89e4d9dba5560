"""Prometheus metrics of the executor process itself (optional
`--metrics-port`): step and forward time, tokens per step, live sequences."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class ExecutorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("cbserve_executor_steps", "Plans executed", registry=r)
        self.step_seconds = Histogram(
            "cbserve_executor_step_duration_seconds",
            "Whole step: plan application, forward, sampling",
            buckets=_SECONDS,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "cbserve_executor_forward_duration_seconds", "Model forward and sampling", buckets=_SECONDS, registry=r
        )
        self.step_tokens = Histogram(
            "cbserve_executor_step_tokens", "Tokens computed per step", buckets=_TOKENS, registry=r
        )
        self.sampled_tokens = Counter("cbserve_executor_sampled_tokens", "Tokens sampled", registry=r)
        self.sequences = Gauge("cbserve_executor_sequences", "Sequences whose state the executor holds", registry=r)
        self.rejected_plans = Counter("cbserve_executor_rejected_plans", "Plans refused as inconsistent", registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Prometheus on host:port (loopback unless told otherwise: this
        process trusts its router, not the network); port 0 = off."""
        if port:
            start_http_server(port, addr=host, registry=self.registry)
