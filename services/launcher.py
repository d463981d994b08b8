"""`spindle serve`: run scheduler, worker(s) and frontend as separate processes on loopback.

The launcher owns process lifecycle only: it picks internal ports, starts each service with
`python -m services.<name>`, waits until the frontend's /health says every service is ready,
announces where it listens, and on Ctrl-C / SIGTERM stops all of them, gently first: frontend
and scheduler drain the requests in flight, then the workers they ran on stop. A child
that dies after start-up is restarted with the same command and ports (backoff from 1 s up to
30 s), as Kubernetes would: the others reconnect to it and nothing in flight is lost. A child
that dies before spindle was ever ready is a configuration error: everything stops. It never
imports torch or the services' code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from services.cpu_affinity import CorePlan, format_cores, plan_cores, worker_env
from shared.api_keys import ApiKeys
from shared.logs import STACK_DUMP_SIGNAL
from shared.ports import distinct_free_ports
from shared.tls import TlsFiles

logger = logging.getLogger(__name__)

# What a child gets beyond its drain time to exit after SIGTERM (closing streams, flushing).
STOP_MARGIN_S = 10.0
STACK_DUMP_WAIT_S = 1.0  # for a child that did not stop to write its threads' stacks before it is killed


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What `spindle serve` was asked for; internal addresses are picked at start."""

    model: str
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50051
    num_workers: int = 1
    served_model_name: str | None = None
    # Extra flags handed through to each service unchanged.
    worker_args: tuple[str, ...] = field(default=())
    scheduler_args: tuple[str, ...] = field(default=())
    frontend_args: tuple[str, ...] = field(default=())
    # Niceness of frontend and scheduler. 0 by default: the worker's OpenMP threads spin between
    # parallel regions, so the worker leaves no gaps for niced services to run in, and a niced
    # frontend or scheduler handed tokens on in bursts and admitted prompts late (README).
    host_services_nice: int = 0
    # Core placement of workers and host services (services/cpu_affinity.py): a policy or a map.
    cpu_affinity: str = "auto"
    # Prometheus ports: frontend here, scheduler +1, worker i +2+i (0: no metrics).
    metrics_port: int = 0
    log_format: str = "text"
    ready_timeout_s: float = 600.0
    # How long frontend and scheduler drain on SIGTERM (their --shutdown-grace-s); each group of
    # children gets this plus STOP_MARGIN_S to exit before it is killed.
    shutdown_grace_s: float = 20.0
    # Handed to the frontend: TLS on the public ports, and the API keys every route but /health needs.
    tls: TlsFiles | None = None
    api_key_file: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535 - 1 - self.num_workers:  # the last port: +1 + num_workers
            raise ValueError(f"metrics_port={self.metrics_port} leaves no room for {self.num_workers + 2} ports")
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers} must be at least 1")
        if not os.path.isdir(self.model):
            raise ValueError(f"model={self.model!r} is not a directory")
        if self.api_key_file:
            ApiKeys.load(self.api_key_file)  # a missing or empty key file stops `serve` before any child starts
        self.core_plan()  # a bad --cpu-affinity stops `serve` before any child starts

    def core_plan(self) -> CorePlan:
        return plan_cores(self.cpu_affinity, self.num_workers, sorted(os.sched_getaffinity(0)))


@dataclass(slots=True)
class _Restart:
    """Restart bookkeeping of one child: exponential backoff, reset after a long healthy run."""

    count: int = 0
    delay_s: float = 0.0
    due_at: float | None = None
    last_at: float = 0.0

    def schedule(self, now: float) -> None:
        healthy_for = now - self.last_at
        self.delay_s = 1.0 if healthy_for > 60.0 or self.count == 0 else min(self.delay_s * 2, 30.0)
        self.due_at = now + self.delay_s
        self.last_at = now


def _probe_context(tls: TlsFiles | None) -> ssl.SSLContext | None:
    """TLS for the readiness probe of our own frontend.

    NOTE: verification is off on purpose: the probe reaches the child we started, on this host,
    by an address (127.0.0.1) the certificate need not name, and /health carries no secret.
    """
    if tls is None:
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class Launcher:
    """Starts the three services, waits for readiness, and stops them together."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._commands: dict[str, tuple[list[str], int, dict[str, str]]] = {}  # name -> (command, nice, env)
        self._restarts: dict[str, _Restart] = {}
        self._stopping = False

    def _spawn(self, name: str, module: str, args: list[str], nice: int = 0, metrics_offset: int = 0,
               cores: tuple[int, ...] = (), env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", module, *args, "--log-format", self.config.log_format]
        if self.config.metrics_port:
            cmd += ["--metrics-port", str(self.config.metrics_port + metrics_offset)]
        if cores:
            cmd += ["--cpu-cores", format_cores(cores)]
        self._commands[name] = (cmd, nice, env or {})
        self._popen(name)

    def _popen(self, name: str) -> None:
        cmd, nice, env = self._commands[name]
        logger.info("starting %s%s: %s", name, f" (nice {nice})" if nice else "", " ".join(cmd))
        self.children[name] = subprocess.Popen(cmd, preexec_fn=(lambda: os.nice(nice)) if nice else None,
                                               env={**os.environ, **env} if env else None)

    def _restart_dead(self) -> None:
        """Restart children that exited, each after its backoff (called every 0.2 s while serving)."""
        now = time.monotonic()
        for name, proc in self.children.items():
            if proc.poll() is None:
                continue
            restart = self._restarts.setdefault(name, _Restart())
            if restart.due_at is None:
                restart.schedule(now)
                logger.error("%s exited with code %s; restarting it in %.0f s (restart #%d)", name, proc.returncode,
                             restart.delay_s, restart.count + 1)
            elif now >= restart.due_at:
                restart.count += 1
                restart.due_at = None
                self._popen(name)

    def start(self) -> None:
        cfg = self.config
        # Not the frontend's own ports: they are free until the frontend binds them.
        *worker_ports, scheduler_port = distinct_free_ports(cfg.num_workers + 1, frozenset((cfg.port, cfg.grpc_port)))
        worker_addrs = [f"127.0.0.1:{port}" for port in worker_ports]
        scheduler_addr = f"127.0.0.1:{scheduler_port}"
        plan = cfg.core_plan()
        if plan.is_pinned:
            logger.info("cpu affinity %s: workers on %s, frontend and scheduler on %s", cfg.cpu_affinity,
                        " | ".join(format_cores(c) or "any" for c in plan.workers), format_cores(plan.host) or "any")
        for i, addr in enumerate(worker_addrs):
            self._spawn(f"worker-{i}", "services.worker",
                        ["--model", cfg.model, "--listen", addr, *cfg.worker_args], metrics_offset=2 + i,
                        cores=plan.workers[i], env=worker_env(plan.workers[i]))
        self._spawn("scheduler", "services.scheduler",
                    ["--listen", scheduler_addr, "--workers-addr", ",".join(worker_addrs),
                     *cfg.scheduler_args], nice=cfg.host_services_nice, metrics_offset=1, cores=plan.host)
        frontend = ["--model", cfg.model, "--scheduler-addr", scheduler_addr, "--host", cfg.host,
                    "--port", str(cfg.port), "--grpc-port", str(cfg.grpc_port)]
        if cfg.served_model_name:
            frontend += ["--served-model-name", cfg.served_model_name]
        if cfg.tls:
            frontend += ["--tls-cert-file", cfg.tls.cert_file, "--tls-key-file", cfg.tls.key_file]
        if cfg.api_key_file:
            frontend += ["--api-key-file", cfg.api_key_file]
        self._spawn("frontend", "services.frontend", [*frontend, *cfg.frontend_args], nice=cfg.host_services_nice,
                    cores=plan.host)

    def health_url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::", "") else self.config.host
        return f"{self.scheme}://{host}:{self.config.port}/health"

    @property
    def scheme(self) -> str:
        return "https" if self.config.tls else "http"

    def dead_child(self) -> str | None:
        """Name of a child that exited, if any."""
        for name, proc in self.children.items():
            if proc.poll() is not None:
                return name
        return None

    def wait_ready(self) -> bool:
        """Poll /health until 200; False if a child died, we were stopped, or time ran out."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        last_note = time.monotonic()
        probe = _probe_context(self.config.tls)
        while time.monotonic() < deadline and not self._stopping:
            dead = self.dead_child()
            if dead:
                logger.error("%s exited with code %s before spindle was ready", dead,
                             self.children[dead].returncode)
                return False
            try:
                with urllib.request.urlopen(self.health_url(), timeout=2, context=probe) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - last_note > 10:
                logger.info("waiting for services to become ready (model loading)...")
                last_note = time.monotonic()
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        """Stop every child: frontend and scheduler first, the workers once both are gone.

        On SIGTERM frontend and scheduler drain: new requests are refused and those in flight get
        `shutdown_grace_s` to finish. The workers must keep running meanwhile, or the requests
        draining would have nothing to run on; so they are stopped only after.
        """
        self._stopping = True
        self._terminate([n for n in ("frontend", "scheduler") if n in self.children])
        self._terminate([n for n in self.children if n.startswith("worker")])

    def _terminate(self, names: list[str]) -> None:
        """SIGTERM the children `names` together; SIGKILL any still alive after the grace period."""
        for name in names:
            if self.children[name].poll() is None:
                self.children[name].send_signal(signal.SIGTERM)
        grace_s = self.config.shutdown_grace_s + STOP_MARGIN_S
        deadline = time.monotonic() + grace_s
        for name in names:
            proc = self.children[name]
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0f s; its threads' stacks follow, then it is killed",
                               name, grace_s)
                proc.send_signal(STACK_DUMP_SIGNAL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STACK_DUMP_WAIT_S)  # time to write the stacks (it may exit meanwhile)
                proc.kill()
                proc.wait()

    def run(self) -> int:
        """Serve until a signal or a child's death; returns the process exit code."""
        def on_signal(signum: int, _frame: object) -> None:
            logger.info("received %s, stopping", signal.Signals(signum).name)
            self._stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        try:
            if not self.wait_ready():
                return 0 if self._stopping else 1
            cfg = self.config
            shown = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
            name = cfg.served_model_name or os.path.basename(cfg.model.rstrip("/"))
            sys.stdout.write(
                f"spindle is ready: OpenAI HTTP {self.scheme}://{shown}:{cfg.port}/v1  "
                f"gRPC {shown}:{cfg.grpc_port}  (model {name})\n"
            )
            sys.stdout.flush()
            while not self._stopping:
                self._restart_dead()
                time.sleep(0.2)
            return 0
        finally:
            self.stop()
