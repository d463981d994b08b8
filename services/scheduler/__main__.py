"""Entry point of the scheduler service: flags (SPINDLE_* env defaults) -> SchedulerConfig -> serve.

`python -m services.scheduler --workers-addr HOST:PORT[,HOST:PORT...]` or `spindle scheduler ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys

from grpc_health.v1 import health_pb2

from services.cpu_affinity import add_cpu_cores_argument
from services.scheduler.config import DEFAULT_LISTEN, DEFAULT_WORKER_ADDRS, SchedulerConfig
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer, register
from services.scheduler.step_socket import StepSocket
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.worker_client import WorkerClient
from shared.grpc_server import start_grpc, wait_for_shutdown
from shared.metrics import serve_metrics
from shared.service_flags import (
    add_internal_tls_arguments,
    add_observability_arguments,
    internal_tls_from_args,
    metrics_port_from_args,
)
from shared.startup_heap import freeze_startup_heap
from shared.state_store import open_state_store
from shared.step_dial import STEP_TRANSPORTS
from shared.tls import grpc_server_credentials
from shared.tracing import Tracing

logger = logging.getLogger(__name__)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPINDLE_{name}", default)


def _env_bool(name: str, default: bool) -> bool:
    return _env(name, str(default)).strip().lower() in ("1", "true", "yes", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SchedulerConfig()
    parser.add_argument("--listen", default=_env("SCHEDULER_LISTEN", DEFAULT_LISTEN),
                        help="host:port of the SchedulerService [SPINDLE_SCHEDULER_LISTEN]")
    parser.add_argument("--workers-addr", default=_env("WORKER_ADDRS", DEFAULT_WORKER_ADDRS),
                        help="comma-separated worker host:port list, one per data-parallel worker "
                             "[SPINDLE_WORKER_ADDRS]")
    for flag, env, default, help_text in (
        ("--max-num-seqs", "MAX_NUM_SEQS", defaults.max_num_seqs, "most running requests per worker"),
        ("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS", defaults.max_num_batched_tokens,
         "token budget of one round's first step per worker"),
        ("--num-scheduler-steps", "NUM_SCHEDULER_STEPS", defaults.num_scheduler_steps,
         "decode steps per round when no prefill is pending (multi-step)"),
        ("--max-scheduler-steps", "MAX_SCHEDULER_STEPS", defaults.max_scheduler_steps,
         "the most steps a round grows to while the worker's steps are short (--round-target-ms)"),
        ("--max-step-tokens-per-decode", "MAX_STEP_TOKENS_PER_DECODE", defaults.max_step_tokens_per_decode,
         "while requests decode, a step computes at most S x this tokens, S the streams decoding or waiting "
         "(bounds the stall a burst of prefills causes; 0 = off)"),
        ("--max-inflight-rounds", "MAX_INFLIGHT_ROUNDS", defaults.max_inflight_rounds,
         "rounds sent ahead to a worker (2 = pipelined)"),
        ("--pipeline-quiet-rounds", "PIPELINE_QUIET_ROUNDS", defaults.pipeline_quiet_rounds,
         "rounds without admissions before a multi-step round is sent ahead (0 = always)"),
        ("--max-waiting-requests", "MAX_WAITING_REQUESTS", defaults.max_waiting_requests,
         "most requests waiting for admission; past it new ones are refused (RESOURCE_EXHAUSTED, HTTP 429)"),
        ("--max-waiting-tokens", "MAX_WAITING_TOKENS", defaults.max_waiting_tokens,
         "most prompt tokens waiting for admission; past it new requests are refused"),
        ("--limit-mm-per-prompt", "LIMIT_MM_PER_PROMPT", defaults.limit_mm_per_prompt,
         "most images per request (vision-language models); sizes the encoder-cache budget"),
    ):
        parser.add_argument(flag, type=int, default=int(_env(env, str(default))), help=f"{help_text} [SPINDLE_{env}]")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=_env_bool("ENABLE_PREFIX_CACHING", defaults.enable_prefix_caching),
                        help="share computed KV blocks between requests [SPINDLE_ENABLE_PREFIX_CACHING]")
    parser.add_argument("--enable-priority-preemption", action=argparse.BooleanOptionalAction,
                        default=_env_bool("ENABLE_PRIORITY_PREEMPTION", defaults.enable_priority_preemption),
                        help="waiting requests may preempt lower-priority running ones "
                             "[SPINDLE_ENABLE_PRIORITY_PREEMPTION]")
    parser.add_argument("--round-target-ms", type=float,
                        default=float(_env("ROUND_TARGET_MS", str(defaults.round_target_ms))),
                        help="while the worker's steps are short, a decode round runs as many steps as take about "
                             "this long, past --num-scheduler-steps up to --max-scheduler-steps (each round costs "
                             "a fixed hand-over; 0: always --num-scheduler-steps) [SPINDLE_ROUND_TARGET_MS]")
    parser.add_argument("--pipeline-lead-ms", type=float,
                        default=float(_env("PIPELINE_LEAD_MS", str(defaults.pipeline_lead_ms))),
                        help="until rounds are quiet, send the next multi-step round once the one in flight ends "
                             "within this long (hides the round trip where steps are short; 0: never) "
                             "[SPINDLE_PIPELINE_LEAD_MS]")
    parser.add_argument("--step-transport", choices=STEP_TRANSPORTS,
                        default=_env("STEP_TRANSPORT", defaults.step_transport),
                        help="socket: stream each worker's steps on its step socket where it offers one (less CPU "
                             "a token than gRPC; never with --internal-tls); grpc: always gRPC's Execute "
                             "[SPINDLE_STEP_TRANSPORT]")
    parser.add_argument("--step-port", type=int, default=int(_env("SCHEDULER_STEP_PORT", str(defaults.step_port))),
                        help="TCP port of the scheduler's step socket, where frontends stream their requests "
                             "and each step's updates without gRPC; 0: a free one, -1: none (not offered with "
                             "--internal-tls) [SPINDLE_SCHEDULER_STEP_PORT]")
    parser.add_argument("--worker-ready-timeout-s", type=float,
                        default=float(_env("WORKER_READY_TIMEOUT_S", str(defaults.worker_ready_timeout_s))),
                        help="give up waiting for a worker after this long; 0: wait forever "
                             "[SPINDLE_WORKER_READY_TIMEOUT_S]")
    parser.add_argument("--stats-interval-s", type=float,
                        default=float(_env("STATS_INTERVAL_S", str(defaults.stats_interval_s))),
                        help="period of the counters log while busy [SPINDLE_STATS_INTERVAL_S]")
    parser.add_argument("--state-store", default=_env("STATE_STORE", defaults.state_store),
                        help="journal of accepted requests: memory, or redis://host:port/db (survives a scheduler "
                             "restart) [SPINDLE_STATE_STORE]")
    parser.add_argument("--orphan-timeout-s", type=float,
                        default=float(_env("ORPHAN_TIMEOUT_S", str(defaults.orphan_timeout_s))),
                        help="after a restart, journaled requests wait this long for their frontend "
                             "[SPINDLE_ORPHAN_TIMEOUT_S]")
    parser.add_argument("--max-worker-failures", type=int,
                        default=int(_env("MAX_WORKER_FAILURES", str(defaults.max_worker_failures))),
                        help="a request on this many failing workers fails alone; others move "
                             "[SPINDLE_MAX_WORKER_FAILURES]")
    parser.add_argument("--shutdown-grace-s", type=float,
                        default=float(_env("SHUTDOWN_GRACE_S", str(defaults.shutdown_grace_s))),
                        help="on SIGTERM, running requests get this long to finish (the rest stay journaled) "
                             "[SPINDLE_SHUTDOWN_GRACE_S]")
    add_observability_arguments(parser)
    add_cpu_cores_argument(parser)
    add_internal_tls_arguments(parser)


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        listen=args.listen,
        worker_addresses=tuple(a.strip() for a in args.workers_addr.split(",") if a.strip()),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_scheduler_steps=args.num_scheduler_steps,
        max_scheduler_steps=args.max_scheduler_steps,
        round_target_ms=args.round_target_ms,
        max_step_tokens_per_decode=args.max_step_tokens_per_decode,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_priority_preemption=args.enable_priority_preemption,
        max_inflight_rounds=args.max_inflight_rounds,
        pipeline_quiet_rounds=args.pipeline_quiet_rounds,
        pipeline_lead_ms=args.pipeline_lead_ms,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        worker_ready_timeout_s=args.worker_ready_timeout_s,
        stats_interval_s=args.stats_interval_s,
        metrics_port=metrics_port_from_args(args),
        internal_tls=internal_tls_from_args(args),
        step_transport=args.step_transport,
        step_port=args.step_port,
        state_store=args.state_store,
        orphan_timeout_s=args.orphan_timeout_s,
        max_worker_failures=args.max_worker_failures,
        shutdown_grace_s=args.shutdown_grace_s,
    )


async def serve(config: SchedulerConfig) -> None:
    """Listen at once (GetSchedulerInfo says ready=False), turn SERVING once every worker is ready."""
    links = [WorkerClient(i, addr, config.worker_ready_timeout_s, tls=config.internal_tls,
                          step_socket=config.step_transport == "socket")
             for i, addr in enumerate(config.worker_addresses)]
    tracing = Tracing.from_env("scheduler")
    # The lambda reads `engine` at scrape time: the scheduler exists once every worker is ready.
    metrics = SchedulerMetrics(lambda: engine.scheduler)
    store = open_state_store(config.state_store)
    if not store.outlives_process:
        logger.info("no request journal: the %r state store would not outlive this process", config.state_store)
    engine = EngineLoop(config, links, observer=SchedulerTelemetry(tracing, metrics),
                        store=store if store.outlives_process else None)
    servicer = SchedulerServicer(engine)
    svc = await start_grpc(config.listen, lambda server: register(server, servicer), [SERVICE_NAME],
                           credentials=grpc_server_credentials(config.internal_tls))
    step_socket = StepSocket(servicer)
    if config.internal_tls is not None:
        logger.info("no step socket: with internal TLS frontends connect over gRPC")
    elif config.step_port >= 0:
        servicer.step_port = await step_socket.start(config.listen.rsplit(":", 1)[0], config.step_port)
        servicer.step_local_socket = step_socket.local_name

    def on_ready_change(ready: bool) -> None:
        """Health tells the truth: NOT_SERVING while no worker can serve."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.get_running_loop().create_task(svc.health.set(SERVICE_NAME, status))

    engine.on_ready_change = on_ready_change
    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = await serve_metrics(metrics.registry, config.listen.rsplit(":", 1)[0], config.metrics_port)
    logger.info("listening on %s; waiting for %d worker(s): %s", svc.address, len(links),
                ", ".join(config.worker_addresses))

    failed = False

    async def start_engine() -> None:
        nonlocal failed
        try:
            await engine.start()
        except Exception:
            logger.exception("the workers never became ready; stopping")
            failed = True
            await svc.server.stop(0)
            return
        freeze_startup_heap()
        await svc.set_serving([SERVICE_NAME])

    starter = asyncio.create_task(start_engine())

    async def on_stop() -> None:
        starter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starter
        await engine.drain(config.shutdown_grace_s)
        await engine.stop()  # ends every frontend's stream, on either transport
        step_socket.close()
        await store.close()
        if metrics_server is not None:
            await metrics_server.stop()
        tracing.shutdown()

    await wait_for_shutdown(svc, on_stop=on_stop)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    from services.cli import run_service

    run_service("scheduler", sys.modules[__name__])
