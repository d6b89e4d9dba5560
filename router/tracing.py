"""Optional OpenTelemetry tracing: one span per request, from admission to
finish, with events for queueing, each prefill chunk, the first token,
preemptions and the finish. With `tracing.exporter: none` (the default) no
OpenTelemetry code is imported and every hook is a no-op."""

from __future__ import annotations

import structlog

from router.config import ConfigError, TracingConfig

_LOGGER = structlog.get_logger(__name__)


class RequestTracer:
    """Wraps an OpenTelemetry tracer; `None`-safe helpers keep call sites short."""

    def __init__(self, tracer, provider) -> None:
        self._tracer = tracer
        self._provider = provider

    def start(self, req):
        span = self._tracer.start_span(
            "cbserve.request",
            attributes={
                "cbserve.request_id": req.request_id,
                "cbserve.prompt_tokens": len(req.prompt_token_ids),
                "cbserve.max_new_tokens": req.stopping.max_new_tokens,
                "cbserve.priority": req.priority,
                "cbserve.tenant": req.tenant,
                "cbserve.slo_class": req.slo_class,
            },
        )
        span.add_event("queued")
        return span

    @staticmethod
    def event(span, name: str, **attrs) -> None:
        if span is not None:
            span.add_event(name, attributes=attrs)

    @staticmethod
    def finish(span, req, status: str, reason: str) -> None:
        if span is None:
            return
        span.set_attribute("cbserve.output_tokens", len(req.output_token_ids))
        span.set_attribute("cbserve.cached_prompt_tokens", req.num_cached_prompt_tokens)
        span.set_attribute("cbserve.finish_reason", reason)
        span.set_attribute("cbserve.status", status)
        span.add_event("finished", attributes={"finish_reason": reason, "status": status})
        if status not in ("OK", "CANCELLED"):
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, status))
        span.end()

    def shutdown(self) -> None:
        self._provider.force_flush(5000)
        self._provider.shutdown()


def setup_tracing(cfg: TracingConfig) -> RequestTracer | None:
    if cfg.exporter == "none":
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigError(
            "tracing.exporter: otlp needs the OpenTelemetry packages: "
            "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc"
        ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=cfg.otlp_insecure)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    _LOGGER.info("tracing on", exporter=cfg.exporter, endpoint=cfg.otlp_endpoint)
    return RequestTracer(provider.get_tracer("cbserve.router"), provider)
