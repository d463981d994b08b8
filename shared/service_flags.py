"""Command-line flags every service shares: metrics port, log format, request logging.

Each service's `add_arguments` calls `add_observability_arguments`; tracing needs no flag (the
standard `OTEL_*` environment variables switch it on, see shared/tracing.py).
"""

from __future__ import annotations

import argparse
import os

from shared.logs import LOG_FORMATS


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    metrics_port = os.environ.get("SPINDLE_METRICS_PORT", "0")
    parser.add_argument("--metrics-port", type=int, default=int(metrics_port or "0"),
                        help="serve Prometheus /metrics on this port; 0: off [SPINDLE_METRICS_PORT]")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("SPINDLE_LOG_FORMAT", "text"),
                        help="text (key=value, for a terminal) or json (one object per line) [SPINDLE_LOG_FORMAT]")
    parser.add_argument("--log-requests", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("SPINDLE_LOG_REQUESTS", "").lower() in ("1", "true", "yes", "on"),
                        help="log prompts and outputs (off: they may be private) [SPINDLE_LOG_REQUESTS]")


def metrics_port_from_args(args: argparse.Namespace) -> int | None:
    """The config's metrics port: None when the flag is 0 (off)."""
    return args.metrics_port or None
