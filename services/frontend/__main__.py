"""Entry point of the frontend service: flags (SPINDLE_* env defaults) -> FrontendConfig -> serve.

`python -m services.frontend --model DIR --scheduler-addr HOST:PORT` or `spindle frontend ...`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from services.cpu_affinity import add_cpu_cores_argument
from services.frontend.config import FrontendConfig
from services.frontend.limits import RequestLimits
from services.frontend.server import Frontend
from shared.grpc_server import wait_for_shutdown
from shared.service_flags import (
    add_api_key_arguments,
    add_internal_tls_arguments,
    add_observability_arguments,
    add_public_tls_arguments,
    api_keys_from_args,
    internal_tls_from_args,
    metrics_port_from_args,
    public_tls_from_args,
)
from shared.startup_heap import freeze_startup_heap
from shared.step_dial import STEP_TRANSPORTS
from shared.tracing import Tracing


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPINDLE_{name}", default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=_env("MODEL", ""),
                        help="model directory: tokenizer, chat template, generation_config.json [SPINDLE_MODEL]")
    parser.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME", ""),
                        help="model id clients use (default: the model directory's name) [SPINDLE_SERVED_MODEL_NAME]")
    parser.add_argument("--scheduler-addr", default=_env("SCHEDULER_ADDR", "127.0.0.1:50052"),
                        help="scheduler host:port [SPINDLE_SCHEDULER_ADDR]")
    parser.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="bind host [SPINDLE_HOST]")
    parser.add_argument("--port", type=int, default=int(_env("PORT", "8000")),
                        help="OpenAI-compatible HTTP port [SPINDLE_PORT]")
    parser.add_argument("--grpc-port", type=int, default=int(_env("GRPC_PORT", "50051")),
                        help="public gRPC port [SPINDLE_GRPC_PORT]")
    parser.add_argument("--default-max-tokens", type=int, default=int(_env("DEFAULT_MAX_TOKENS", "256")),
                        help="max_tokens when a request leaves it unset, capped to the context "
                             "[SPINDLE_DEFAULT_MAX_TOKENS]")
    parser.add_argument("--request-timeout-s", type=float, default=float(_env("REQUEST_TIMEOUT_S", "600")),
                        help="abort requests running longer than this; 0: never [SPINDLE_REQUEST_TIMEOUT_S]")
    parser.add_argument("--tokenizer-threads", type=int, default=int(_env("TOKENIZER_THREADS", "1")),
                        help="threads tokenizing off the event loop [SPINDLE_TOKENIZER_THREADS]")
    for limit in fields(RequestLimits):
        env = limit.name.upper()
        parser.add_argument(f"--{limit.name.replace('_', '-')}", type=int, default=int(_env(env, str(limit.default))),
                            help=f"{limit.metadata['help']} [SPINDLE_{env}]")
    parser.add_argument("--shutdown-grace-s", type=float, default=float(_env("SHUTDOWN_GRACE_S", "20")),
                        help="on SIGTERM, requests in flight get this long to finish [SPINDLE_SHUTDOWN_GRACE_S]")
    parser.add_argument("--rate-limit-rpm", type=int, default=int(_env("RATE_LIMIT_RPM", "0")),
                        help="requests per minute per API key; 0: no limit [SPINDLE_RATE_LIMIT_RPM]")
    parser.add_argument("--state-store", default=_env("STATE_STORE", "memory"),
                        help="where rate-limit counters live: memory, or redis://host:port/db to share them "
                             "between replicas [SPINDLE_STATE_STORE]")
    parser.add_argument("--step-transport", choices=STEP_TRANSPORTS, default=_env("STEP_TRANSPORT", "socket"),
                        help="socket: stream requests and their updates on the scheduler's step socket where it "
                             "offers one (less CPU a token than gRPC; never with --internal-tls); grpc: always "
                             "gRPC's Connect [SPINDLE_STEP_TRANSPORT]")
    add_observability_arguments(parser)
    add_cpu_cores_argument(parser)
    add_api_key_arguments(parser)
    add_public_tls_arguments(parser)
    add_internal_tls_arguments(parser)


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        model=args.model,
        served_model_name=args.served_model_name or "",
        scheduler_addr=args.scheduler_addr,
        host=args.host,
        http_port=args.port,
        grpc_port=args.grpc_port,
        default_max_tokens=args.default_max_tokens,
        request_timeout_s=args.request_timeout_s,
        limits=RequestLimits(**{limit.name: getattr(args, limit.name) for limit in fields(RequestLimits)}),
        tokenizer_threads=args.tokenizer_threads,
        metrics_port=metrics_port_from_args(args),
        log_requests=args.log_requests,
        shutdown_grace_s=args.shutdown_grace_s,
        rate_limit_rpm=args.rate_limit_rpm,
        state_store=args.state_store,
        api_keys=api_keys_from_args(args),
        tls=public_tls_from_args(args),
        internal_tls=internal_tls_from_args(args),
        step_transport=args.step_transport,
    )


async def serve(config: FrontendConfig) -> None:
    """Serve gRPC and HTTP until SIGTERM/SIGINT; health turns SERVING once the scheduler is ready."""
    frontend = Frontend(config, Tracing.from_env("frontend"))
    await frontend.start()
    freeze_startup_heap()
    assert frontend.grpc is not None
    await wait_for_shutdown(frontend.grpc, on_stop=frontend.drain)
    await frontend.stop()


if __name__ == "__main__":
    from services.cli import run_service

    run_service("frontend", sys.modules[__name__])
