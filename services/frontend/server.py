"""Frontend: assembles tokenizer, scheduler connection, engine, gRPC and HTTP servers.

`__main__.serve` and the tests both start the service through this class, so they run the
same wiring. Health (gRPC and HTTP /health) follows the scheduler connection: SERVING only
while the stream is up and the scheduler reports ready.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from grpc_health.v1 import health_pb2

from services.frontend.config import FrontendConfig
from services.frontend.engine_client import EngineClient
from services.frontend.generation_defaults import GenerationDefaults
from services.frontend.http_app import build_app, start_http
from services.frontend.metrics import FrontendMetrics
from services.frontend.pooling import PoolingClient, model_normalizes
from services.frontend.rate_limit import RateLimiter
from services.frontend.scheduler_client import SchedulerClient
from services.frontend.servicer import SERVICE_NAME, register
from services.frontend.telemetry import FrontendTelemetry
from services.frontend.tokenizer import Tokenizer
from shared.grpc_auth import ApiKeyInterceptor
from shared.grpc_server import GrpcService, start_grpc
from shared.metrics import MetricsServer, serve_metrics
from shared.state_store import open_state_store
from shared.tls import grpc_server_credentials, server_ssl_context
from shared.tracing import Tracing

logger = logging.getLogger(__name__)


class Frontend:
    """One running frontend replica. `start()`, then `stop()`; addresses are known after start."""

    def __init__(self, config: FrontendConfig, tracing: Tracing | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing.disabled()
        self.metrics = FrontendMetrics(config.served_model_name)
        telemetry = FrontendTelemetry(config.served_model_name, self.tracing, self.metrics, config.log_requests)
        self.tokenizer = Tokenizer(config.model, config.tokenizer_threads)
        self.scheduler = SchedulerClient(config.scheduler_addr, backoff_max_s=config.scheduler_backoff_max_s,
                                         tls=config.internal_tls, step_socket=config.step_transport == "socket")
        self.scheduler.on_step_transit = self.metrics.step_transit.observe
        self.store = open_state_store(config.state_store)
        limiter = RateLimiter(self.store, config.rate_limit_rpm) if config.rate_limit_rpm else None
        self.engine = EngineClient(config, self.tokenizer, self.scheduler,
                                   GenerationDefaults.from_model_dir(config.model), telemetry, limiter)
        self.pooling = PoolingClient(config.served_model_name, self.tokenizer, self.scheduler,
                                     model_normalizes(config.model), telemetry, config.limits,
                                     config.request_timeout_s, limiter)
        self.metrics_server: MetricsServer | None = None
        self.grpc: GrpcService | None = None
        self.http_runner: web.AppRunner | None = None
        self.http_address = ""
        self._health_tasks: set[asyncio.Task[None]] = set()

    @property
    def grpc_address(self) -> str:
        assert self.grpc is not None, "start() first"
        return self.grpc.address

    async def start(self) -> None:
        if self.config.metrics_port is not None:
            self.metrics_server = await serve_metrics(self.metrics.registry, self.config.host,
                                                      self.config.metrics_port)
        tls, api_keys = self.config.tls, self.config.api_keys
        self.grpc = await start_grpc(
            self.config.grpc_address, register(self.engine, self.pooling), [SERVICE_NAME],
            credentials=grpc_server_credentials(tls),
            interceptors=[ApiKeyInterceptor(api_keys)] if api_keys.is_enabled else [],
            max_receive_bytes=self.config.limits.max_body_bytes,
        )
        self.http_runner, self.http_address = await start_http(
            build_app(self.engine, self.pooling, api_keys), self.config.host, self.config.http_port,
            server_ssl_context(tls),
        )
        self.scheduler.on_ready_change.append(self._on_scheduler_ready)
        self.scheduler.start()
        logger.info("listening on %s (gRPC%s) and %s://%s (OpenAI HTTP), model %s; scheduler at %s%s; %s",
                    self.grpc.address, ", TLS" if tls else "", "https" if tls else "http", self.http_address,
                    self.config.served_model_name, self.config.scheduler_addr,
                    " (mutual TLS)" if self.config.internal_tls else "",
                    f"{len(api_keys.digests)} API key(s) required" if api_keys.is_enabled else "no API key required")

    def _on_scheduler_ready(self, ready: bool) -> None:
        task = asyncio.create_task(self._set_health(ready))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, ready: bool) -> None:
        assert self.grpc is not None
        if ready:
            await self.grpc.set_serving([SERVICE_NAME])
            logger.info("ready: serving %s", self.config.served_model_name)
            return
        await self.grpc.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        level = self.scheduler.loss_level
        logger.log(level, "not ready: lost the scheduler, %s",
                   "reconnecting" if level == logging.WARNING else "while this frontend drains")

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, give those in flight `shutdown_grace_s` to finish, stop HTTP."""
        self.scheduler.accepting = False
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.scheduler.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.scheduler.num_in_flight:
            logger.warning("%d request(s) still running after %.0f s; they are cancelled",
                           self.scheduler.num_in_flight, self.config.shutdown_grace_s)
        await self.stop_http()

    async def stop_http(self) -> None:
        """Stop taking HTTP requests (in-flight ones are cancelled, which aborts them)."""
        if self.http_runner is not None:
            await self.http_runner.cleanup()
            self.http_runner = None

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.stop_http()
        if self.grpc is not None:
            await self.grpc.server.stop(grace_s)
        await self.scheduler.close()
        self.tokenizer.close()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        await self.store.close()
        self.tracing.shutdown()
