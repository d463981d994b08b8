"""Structured logs: JSON lines with request and trace ids; the key=value form carries the same."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from shared.logs import JsonFormatter, KeyValueFormatter, request_extra, setup_logging

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _record(msg: str, extra: dict[str, str] | None = None) -> logging.LogRecord:
    record = logging.LogRecord("services.x", logging.INFO, __file__, 1, msg, (), None)
    for key, value in (extra or {}).items():
        setattr(record, key, value)
    return record


def test_json_line_carries_request_and_trace_ids() -> None:
    line = JsonFormatter("scheduler").format(_record('queued "now"', request_extra("r-1", TRACEPARENT)))
    out = json.loads(line)
    assert out["msg"] == 'queued "now"' and out["service"] == "scheduler" and out["level"] == "info"
    assert (out["request_id"], out["trace_id"], out["span_id"]) == (
        "r-1", "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")


def test_key_value_line_carries_the_same_ids() -> None:
    line = KeyValueFormatter("frontend").format(_record("finished", request_extra("r-2", TRACEPARENT)))
    assert "request_id=r-2" in line and "trace_id=0af7651916cd43dd8448eb211c80319c" in line
    assert "span_id=b7ad6b7169203331" in line and 'msg="finished"' in line


def test_lines_outside_a_request_have_no_ids_and_malformed_traceparents_are_dropped() -> None:
    out = json.loads(JsonFormatter("worker").format(_record("loaded")))
    assert "request_id" not in out and "trace_id" not in out
    out = json.loads(JsonFormatter("worker").format(_record("x", request_extra("r-3", "garbage"))))
    assert out["request_id"] == "r-3" and "trace_id" not in out


def test_ids_come_from_the_active_span() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        out = json.loads(JsonFormatter("frontend").format(_record("inside")))
    ctx = span.get_span_context()
    assert out["trace_id"] == format(ctx.trace_id, "032x") and out["span_id"] == format(ctx.span_id, "016x")


def test_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format 'xml'"):
        setup_logging("frontend", fmt="xml")
