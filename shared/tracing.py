"""OpenTelemetry tracing for every service: off (and free) unless an OTLP endpoint is set.

`Tracing.from_env(service)` is called once in a service's `__main__`; with the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) set it installs an SDK tracer
provider that batches spans to an OTLP/gRPC collector (every other `OTEL_*` variable, such as
`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` or
`OTEL_EXPORTER_OTLP_HEADERS`, is read by the SDK as usual). Otherwise `enabled` is False and
callers skip every span call: the hot paths test one attribute and do nothing else.

Trace context crosses services as a W3C `traceparent` string inside the request messages, so
each service's request span is the child of the previous service's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]


def parse_traceparent(traceparent: str) -> Context | None:
    """The context a W3C `traceparent` names (None when empty or malformed)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def format_traceparent(span: Span) -> str:
    """The W3C `traceparent` of `span`, to hand to the next service."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def trace_ids(traceparent: str) -> tuple[str, str]:
    """(trace_id, span_id) as hex from a traceparent, for log lines; ("", "") if malformed."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return "", ""
    return parts[1], parts[2]


class Tracing:
    """A service's tracer, or a disabled stand-in whose callers skip all span work.

    Attributes:
        enabled: spans are recorded and exported; when False no method below is called.
        tracer: the OpenTelemetry tracer (a no-op one when disabled).
    """

    def __init__(self, tracer: trace.Tracer, provider: Any = None) -> None:
        self.tracer = tracer
        self.enabled = provider is not None
        self._provider = provider

    @classmethod
    def disabled(cls) -> Tracing:
        return cls(trace.NoOpTracer())

    @classmethod
    def from_env(cls, service: str, env: Mapping[str, str] | None = None) -> Tracing:
        """Export to the OTLP endpoint in the environment, or stay disabled when none is set."""
        env = os.environ if env is None else env
        endpoint = next((env[v] for v in _ENDPOINT_VARS if env.get(v)), "")
        if not endpoint or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls.disabled()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME over this default.
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: f"spindle-{service}"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        logger.info("tracing on: spans go to %s", endpoint)
        return cls(provider.get_tracer(f"spindle.{service}"), provider)

    def start_span(self, name: str, traceparent: str = "", kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, AttributeValue] | None = None, start_time_ns: int | None = None,
                   links: Sequence[Link] = ()) -> Span:
        """A span that is the child of `traceparent` (a new trace when it is empty)."""
        return self.tracer.start_span(name, context=parse_traceparent(traceparent), kind=kind,
                                      attributes=attributes, start_time=start_time_ns, links=links)

    @staticmethod
    def link(traceparent: str) -> Link | None:
        """A span link to the span a traceparent names (None when malformed)."""
        ctx = parse_traceparent(traceparent)
        if ctx is None:
            return None
        span_context: SpanContext = trace.get_current_span(ctx).get_span_context()
        return Link(span_context)

    @staticmethod
    def fail(span: Span, message: str) -> None:
        span.set_status(Status(StatusCode.ERROR, message))

    def shutdown(self) -> None:
        """Flush spans still batched (called as the service stops)."""
        if self._provider is not None:
            self._provider.shutdown()


__all__ = ["NonRecordingSpan", "Span", "SpanKind", "Tracing", "format_traceparent", "parse_traceparent",
           "trace_ids"]
