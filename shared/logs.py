"""Structured logging for every service: key=value lines for a terminal, JSON lines for collectors.

`setup_logging(service, fmt=...)` is called once from a service's `__main__`. A record that
belongs to a request carries `request_id`, `trace_id` and `span_id` (`request_extra` builds
them from the request's W3C traceparent; inside an active OpenTelemetry span they are taken
from it), so log lines join their trace in a dashboard. Prompts and outputs are never logged
by default: a service logs them only when started with `--log-requests`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

from opentelemetry import trace

from shared.tracing import trace_ids

# Asks a service to write every thread's Python stack to stderr (services/cli.py registers it; the
# launcher sends it to a child that does not stop in time, before killing it).
STACK_DUMP_SIGNAL = signal.SIGUSR1

REQUEST_KEYS = ("request_id", "trace_id", "span_id")
LOG_FORMATS = ("text", "json")


def request_extra(request_id: str, traceparent: str = "") -> dict[str, str]:
    """`extra=` for a log call about one request: its id and its trace and span ids."""
    trace_id, span_id = trace_ids(traceparent)
    return {"request_id": request_id, "trace_id": trace_id, "span_id": span_id}


def _request_fields(record: logging.LogRecord) -> dict[str, str]:
    fields = {key: value for key in REQUEST_KEYS if (value := getattr(record, key, None))}
    if "trace_id" not in fields:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            fields["trace_id"] = format(ctx.trace_id, "032x")
            fields["span_id"] = format(ctx.span_id, "016x")
    return fields


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=... service=... logger=... msg="..." request_id=... trace_id=...`"""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage().replace('"', "'")
        parts = [
            f"ts={_timestamp(record)}",
            f"level={record.levelname.lower()}",
            f"service={self.service}",
            f"pid={record.process}",
            f"logger={record.name}",
            f'msg="{msg}"',
        ]
        parts += [f"{key}={value}" for key, value in _request_fields(record).items()]
        if record.exc_info:
            parts.append(f'exc="{self.formatException(record.exc_info)}"'.replace("\n", "\\n"))
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the same fields as the key=value form."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "service": self.service,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_request_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(service: str, level: str | None = None, fmt: str = "text") -> None:
    """Configure the root logger for `service` (level from SPINDLE_LOG_LEVEL, default INFO)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else KeyValueFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("SPINDLE_LOG_LEVEL", "INFO")).upper())
