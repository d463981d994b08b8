"""Command-line flags every service shares: metrics port, log format, request logging, TLS files.

Each service's `add_arguments` calls `add_observability_arguments` and
`add_internal_tls_arguments`; tracing needs no flag (the standard `OTEL_*` environment
variables switch it on, see shared/tracing.py).
"""

from __future__ import annotations

import argparse
import os

from shared.api_keys import ApiKeys
from shared.logs import LOG_FORMATS
from shared.tls import INTERNAL_TLS_FLAGS, PUBLIC_TLS_FLAGS, TlsFiles

_TLS_FILE_HELP = {
    "ca": "PEM CA bundle: peers' certificates must chain to it, and servers require client certificates",
    "cert": "PEM certificate chain",
    "key": "PEM private key of that certificate",
}


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    metrics_port = os.environ.get("SPINDLE_METRICS_PORT", "0")
    parser.add_argument("--metrics-port", type=int, default=int(metrics_port or "0"),
                        help="serve Prometheus /metrics on this port; 0: off [SPINDLE_METRICS_PORT]")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("SPINDLE_LOG_FORMAT", "text"),
                        help="text (key=value, for a terminal) or json (one object per line) [SPINDLE_LOG_FORMAT]")
    parser.add_argument("--log-requests", action=argparse.BooleanOptionalAction,
                        default=os.environ.get("SPINDLE_LOG_REQUESTS", "").lower() in ("1", "true", "yes", "on"),
                        help="log prompts and outputs (off: they may be private) [SPINDLE_LOG_REQUESTS]")


def add_tls_arguments(parser: argparse.ArgumentParser, flags: str, purpose: str, with_ca: bool) -> None:
    """`{flags}-cert-file`, `{flags}-key-file` (and `{flags}-ca-file`), each defaulting to its SPINDLE_* variable."""
    for part in ("ca", "cert", "key") if with_ca else ("cert", "key"):
        flag = f"{flags}-{part}-file"
        env = "SPINDLE_" + flag.lstrip("-").replace("-", "_").upper()
        parser.add_argument(flag, default=os.environ.get(env, ""), help=f"{_TLS_FILE_HELP[part]}, {purpose} [{env}]")


def tls_from_args(args: argparse.Namespace, flags: str, with_ca: bool) -> TlsFiles | None:
    """The TlsFiles of a group added by `add_tls_arguments` (None when none of its flags is set)."""
    prefix = flags.lstrip("-").replace("-", "_")
    return TlsFiles.from_flags(flags, getattr(args, f"{prefix}_cert_file"), getattr(args, f"{prefix}_key_file"),
                               getattr(args, f"{prefix}_ca_file") if with_ca else None)


def add_internal_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """Mutual TLS between frontend, scheduler and workers: all three files, or none (plaintext)."""
    add_tls_arguments(parser, INTERNAL_TLS_FLAGS, "for mutual TLS between spindle's services", with_ca=True)


def internal_tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    return tls_from_args(args, INTERNAL_TLS_FLAGS, with_ca=True)


def add_public_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """TLS on the public HTTP and gRPC ports: both files, or none (plaintext)."""
    add_tls_arguments(parser, PUBLIC_TLS_FLAGS, "served on the public HTTP and gRPC ports", with_ca=False)


def public_tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    return tls_from_args(args, PUBLIC_TLS_FLAGS, with_ca=False)


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    # No flag takes a key itself: a command line is visible to every user of the host (ps).
    parser.add_argument("--api-key-file", default=os.environ.get("SPINDLE_API_KEY_FILE", ""),
                        help="require an API key (Authorization: Bearer) on every route but health: one key per "
                             "line, or sha256:<hex> of one; more keys come from SPINDLE_API_KEYS (comma-separated) "
                             "[SPINDLE_API_KEY_FILE]")


def api_keys_from_args(args: argparse.Namespace) -> ApiKeys:
    """The keys of --api-key-file and SPINDLE_API_KEYS, hashed; none: authentication off."""
    return ApiKeys.load(args.api_key_file, os.environ.get("SPINDLE_API_KEYS", ""))


def metrics_port_from_args(args: argparse.Namespace) -> int | None:
    """The config's metrics port: None when the flag is 0 (off)."""
    return args.metrics_port or None
