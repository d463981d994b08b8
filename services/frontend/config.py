"""FrontendConfig: everything the frontend service is configured with, built once in `__main__`.

Frozen and validated here; no module below `__main__` reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from services.frontend.limits import RequestLimits
from shared.api_keys import ApiKeys
from shared.step_dial import STEP_TRANSPORTS
from shared.tls import TlsFiles


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """Settings of one frontend replica.

    Attributes:
        model: model directory (tokenizer, chat template, generation_config.json).
        served_model_name: the id clients use; empty means the model directory's base name.
        scheduler_addr: host:port of the scheduler's SchedulerService.
        host: bind host of both the HTTP and the gRPC server.
        http_port: OpenAI-compatible HTTP port (0 picks a free one).
        grpc_port: public gRPC port (0 picks a free one).
        default_max_tokens: max_tokens when a request leaves it unset, capped to what fits
            in the context after the prompt.
        request_timeout_s: a request still running after this long is aborted (0: never).
        limits: how much one request may ask for (sizes, counts), checked before tokenizing.
        scheduler_backoff_max_s: longest wait between attempts to (re)connect to the scheduler.
        tokenizer_threads: threads that tokenize off the event loop.
        metrics_port: port of the Prometheus /metrics endpoint (None: off; 0: a free port).
        log_requests: log prompts and outputs (never by default).
        api_keys: keys (hashed) every route but health requires; empty: no authentication.
        tls: certificate and key served on the public HTTP and gRPC ports; None: plaintext.
        internal_tls: mutual TLS to the scheduler; None: plaintext.
        step_transport: "socket": the Connect stream runs on the scheduler's step socket where it
            offers one (shared/step_frames.py; never with internal_tls); "grpc": always on gRPC.
    """

    model: str
    served_model_name: str = ""
    scheduler_addr: str = "127.0.0.1:50052"
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 50051
    default_max_tokens: int = 256
    request_timeout_s: float = 600.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    scheduler_backoff_max_s: float = 5.0
    tokenizer_threads: int = 1
    metrics_port: int | None = None
    log_requests: bool = False
    shutdown_grace_s: float = 20.0
    rate_limit_rpm: int = 0
    state_store: str = "memory"
    api_keys: ApiKeys = ApiKeys()
    tls: TlsFiles | None = None
    internal_tls: TlsFiles | None = None
    step_transport: str = "socket"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", os.path.basename(self.model.rstrip("/")))
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name}={port} is not a TCP port")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be at least 1")
        if self.request_timeout_s < 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} must not be negative")
        if self.scheduler_backoff_max_s <= 0:
            raise ValueError(f"scheduler_backoff_max_s={self.scheduler_backoff_max_s} must be positive")
        if self.rate_limit_rpm < 0:
            raise ValueError(f"rate_limit_rpm={self.rate_limit_rpm} must not be negative")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s={self.shutdown_grace_s} must not be negative")
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads={self.tokenizer_threads} must be at least 1")
        if self.step_transport not in STEP_TRANSPORTS:
            raise ValueError(f"step_transport={self.step_transport!r} must be one of {STEP_TRANSPORTS}")
        if ":" not in self.scheduler_addr:
            raise ValueError(f"scheduler_addr={self.scheduler_addr!r} must be host:port")

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"
