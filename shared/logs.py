"""Structured logging for every service: one line per record, key=value pairs.

`setup_logging(service)` is called once from a service's `__main__`. Records may carry
`request_id` and `trace_id` through `extra=`; they are printed when present.
"""

from __future__ import annotations

import logging
import os
import sys
import time


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=... service=... logger=... msg="..." request_id=...`"""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        msg = record.getMessage().replace('"', "'")
        parts = [
            f"ts={ts}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"service={self.service}",
            f"pid={record.process}",
            f"logger={record.name}",
            f'msg="{msg}"',
        ]
        for key in ("request_id", "trace_id"):
            value = getattr(record, key, None)
            if value:
                parts.append(f"{key}={value}")
        if record.exc_info:
            parts.append(f'exc="{self.formatException(record.exc_info)}"'.replace("\n", "\\n"))
        return " ".join(parts)


def setup_logging(service: str, level: str | None = None) -> None:
    """Configure the root logger for `service` (level from SPINDLE_LOG_LEVEL, default INFO)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("SPINDLE_LOG_LEVEL", "INFO")).upper())
