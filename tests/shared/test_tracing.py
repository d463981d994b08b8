"""Tracing switches on only with an OTLP endpoint, and trace context survives the hop between services."""

from __future__ import annotations

from shared.tracing import Tracing, format_traceparent, parse_traceparent, trace_ids

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_off_without_an_endpoint_and_when_the_sdk_is_disabled() -> None:
    assert not Tracing.from_env("frontend", {}).enabled
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"}
    assert not Tracing.from_env("frontend", env).enabled


def test_on_with_an_endpoint_and_spans_continue_the_callers_trace() -> None:
    tracing = Tracing.from_env("scheduler", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9"})
    try:
        assert tracing.enabled
        span = tracing.start_span("child", TRACEPARENT)
        child = format_traceparent(span)
        assert trace_ids(child)[0] == "0af7651916cd43dd8448eb211c80319c"
        assert trace_ids(child)[1] != "b7ad6b7169203331"  # a new span in the same trace
        # Spans are left open: nothing is exported to the endpoint, which does not exist.
        root = tracing.start_span("root", "not-a-traceparent")  # malformed: a new trace, not an error
        assert trace_ids(format_traceparent(root))[0] != "0af7651916cd43dd8448eb211c80319c"
    finally:
        tracing.shutdown()


def test_traceparent_parsing() -> None:
    assert parse_traceparent("") is None and parse_traceparent("00-zz-yy-01") is None
    assert parse_traceparent(TRACEPARENT) is not None
    assert Tracing.link("bad") is None and Tracing.link(TRACEPARENT) is not None
    assert trace_ids("00-abc") == ("", "")
