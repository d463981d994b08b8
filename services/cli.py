"""The `spindle` command: `serve` runs all services; `frontend|scheduler|worker` runs one.

Each service module (`services/<name>/__main__.py`) provides `add_arguments`,
`config_from_args` and `serve`; this file only dispatches, so a service started alone (as on
Kubernetes) and one started by `spindle serve` parse the same flags.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

import uvloop

from services.cpu_affinity import POLICIES, format_cores, pin_process
from services.serve_flags import FRONTEND, SCHEDULER, WORKER, add_serve_flags, service_args, shutdown_grace_s
from shared.logs import LOG_FORMATS, STACK_DUMP_SIGNAL, setup_logging
from shared.service_flags import add_api_key_arguments, add_public_tls_arguments, public_tls_from_args

logger = logging.getLogger(__name__)

SERVICES = ("frontend", "scheduler", "worker")


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory in Hugging Face layout")
    parser.add_argument("--host", default=os.environ.get("SPINDLE_HOST", "0.0.0.0"), help="HTTP bind host")
    parser.add_argument("--port", type=int, default=int(os.environ.get("SPINDLE_PORT", "8000")),
                        help="OpenAI-compatible HTTP port")
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("SPINDLE_GRPC_PORT", "50051")),
                        help="public gRPC port")
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes (data parallel)")
    parser.add_argument("--served-model-name", default=None, help="model id clients use (default: dir name)")
    parser.add_argument("--host-services-nice", type=int,  # argparse converts (and rejects) the env's string too
                        default=os.environ.get("SPINDLE_HOST_SERVICES_NICE", "0"),
                        help="niceness of frontend and scheduler (0: as the worker; README says why "
                             "that is the default) [SPINDLE_HOST_SERVICES_NICE]")
    parser.add_argument("--cpu-affinity", default=os.environ.get("SPINDLE_CPU_AFFINITY", "auto"),
                        help=f"core placement of workers and host services: {' | '.join(POLICIES)} | a map such "
                             "as workers=0-5;host=6-7 (services/cpu_affinity.py) [SPINDLE_CPU_AFFINITY]")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("SPINDLE_METRICS_PORT", "9400")),
                        help="Prometheus /metrics: frontend on this port, scheduler +1, worker i +2+i; 0: off")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=os.environ.get("SPINDLE_LOG_FORMAT", "text"),
                        help="text (key=value) or json (one object per line), for every service")
    parser.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off by default)")
    add_public_tls_arguments(parser)
    add_api_key_arguments(parser)
    # Service flags handed through to the children that take them (services/serve_flags.py).
    add_serve_flags(parser)


def _serve(args: argparse.Namespace) -> int:
    from services.launcher import Launcher, ServeConfig

    try:
        config = ServeConfig(
            model=args.model, host=args.host, port=args.port, grpc_port=args.grpc_port,
            num_workers=args.workers, served_model_name=args.served_model_name,
            host_services_nice=args.host_services_nice, cpu_affinity=args.cpu_affinity,
            metrics_port=args.metrics_port,
            log_format=args.log_format,
            frontend_args=(*service_args(args, FRONTEND), *(("--log-requests",) if args.log_requests else ())),
            worker_args=service_args(args, WORKER), scheduler_args=service_args(args, SCHEDULER),
            tls=public_tls_from_args(args), api_key_file=args.api_key_file, shutdown_grace_s=shutdown_grace_s(args),
        )
    except ValueError as exc:
        sys.stderr.write(f"spindle serve: {exc}\n")
        return 2
    return Launcher(config).run()


class ServiceModule(Protocol):
    """What each `services/<name>/__main__.py` provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...
    def config_from_args(self, args: argparse.Namespace) -> Any: ...
    def serve(self, config: Any) -> Coroutine[Any, Any, None]: ...


def run_service(name: str, module: ServiceModule, argv: Sequence[str] | None = None,
                parser: argparse.ArgumentParser | None = None) -> None:
    """Parse a service's flags, set up logging and serve it until SIGTERM/SIGINT."""
    if parser is None:
        parser = argparse.ArgumentParser(prog=f"spindle {name}", description=f"spindle {name} service")
        module.add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(name, fmt=args.log_format)
    # SIGUSR1 writes every thread's Python stack to stderr: the launcher sends it to a service that
    # does not stop in time, before killing it, so the log says where it hung.
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    if getattr(args, "cpu_cores", ()):
        pin_process(args.cpu_cores)
        logger.info("pinned to cores %s", format_cores(args.cpu_cores))
    try:
        config = module.config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        uvloop.run(module.serve(config))
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as exc:
        # Bad configuration found while starting (missing model files, port in use): say it plainly.
        logger.error("%s cannot start: %s", name, exc)
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="spindle", description="spindle LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_arguments(sub.add_parser("serve", help="run frontend, scheduler and worker(s) together"))
    for name in SERVICES:
        service_parser = sub.add_parser(name, help=f"run the {name} service alone")
        # Import only the chosen service: the worker pulls in torch, which `serve` never needs.
        if argv and argv[0] == name:
            module = importlib.import_module(f"services.{name}.__main__")
            module.add_arguments(service_parser)
            run_service(name, module, argv[1:], service_parser)
            return
    args = parser.parse_args(argv)
    setup_logging(args.command, fmt=args.log_format)
    sys.exit(_serve(args))


if __name__ == "__main__":
    main()
