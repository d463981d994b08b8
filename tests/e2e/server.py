"""Start `spindle serve` as a real process tree for end-to-end tests, and stop it cleanly."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shared.ports import distinct_free_ports

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunningServer:
    http_url: str  # e.g. http://127.0.0.1:8123 (https:// when served with TLS)
    grpc_address: str  # e.g. 127.0.0.1:50123
    model_name: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def spindle_serve(model_dir: Path, *extra_args: str, timeout_s: float = 180.0,
                  extra_env: dict[str, str] | None = None, scheme: str = "http") -> Iterator[RunningServer]:
    """Run `spindle serve` on free loopback ports until the block ends, then SIGTERM it.

    `scheme="https"` when `extra_args` turn TLS on (--tls-cert-file, --tls-key-file).
    """
    http_port, grpc_port = distinct_free_ports(2)
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", "0", *extra_args]
    # One torch thread a worker and no pinning: tests share the machine with the oracle they compare against.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPINDLE_CPU_AFFINITY": "off",
           "SPINDLE_LOG_LEVEL": os.environ.get("SPINDLE_LOG_LEVEL", "WARNING"), **(extra_env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE)
    server = RunningServer(f"{scheme}://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", model_dir.name, proc)
    try:
        _wait_launcher_ready(server, timeout_s)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError("spindle serve did not stop within 30 s of SIGTERM") from None


def _wait_launcher_ready(server: RunningServer, timeout_s: float) -> None:
    """Wait for the launcher's own "spindle is ready" line, not only for /health.

    /health can answer 200 a moment before the launcher's probe sees it; a child killed in that
    moment counts as a start-up failure and stops everything. The launcher restarts dead children
    only once it has printed the line, so a fault test must strike after it. A thread keeps
    draining stdout so the launcher never blocks on a full pipe; its last lines go into the
    failure, as does which services answer, so a start-up that hangs says where.
    """
    ready = threading.Event()
    last_lines: collections.deque[str] = collections.deque(maxlen=40)

    def drain(stream: IO[bytes]) -> None:
        for line in stream:
            last_lines.append(line.decode(errors="replace").rstrip())
            if line.startswith(b"spindle is ready"):
                ready.set()

    def failure(what: str) -> AssertionError:
        output = "\n".join(last_lines) or "(nothing)"
        return AssertionError(f"spindle serve {what}; services: {_children(server.process.pid)}; "
                              f"its last output:\n{output}")

    assert server.process.stdout is not None
    threading.Thread(target=drain, args=(server.process.stdout,), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.1):
        if server.process.poll() is not None:
            raise failure(f"exited early with code {server.process.returncode}")
        if time.monotonic() > deadline:
            raise failure(f"not ready after {timeout_s} s")


def _children(pid: int) -> str:
    """The launcher's child processes by service module, from /proc (Linux; else "?")."""
    try:
        children = (Path(f"/proc/{pid}/task/{pid}/children").read_text()).split()
        names = []
        for child in children:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            module = next((a.decode() for a in argv if a.startswith(b"services.")), argv[0].decode())
            names.append(f"{module} (pid {child})")
        return ", ".join(names) or "none running"
    except OSError:
        return "?"


def _wait_healthy(server: RunningServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    # Readiness only: a TLS test checks the certificate itself, with its own CA.
    unverified = ssl.create_default_context()
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"spindle serve exited early with code {server.process.returncode}")
        try:
            with urllib.request.urlopen(server.http_url + "/health", timeout=2, context=unverified) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"spindle serve not healthy after {timeout_s} s")


@dataclass(frozen=True)
class StandaloneServices:
    """The services started one by one (as on Kubernetes), with every address known."""

    server: RunningServer
    scheduler_address: str
    worker_addresses: list[str]
    processes: list[subprocess.Popen[bytes]]


@contextlib.contextmanager
def spindle_services(model_dir: Path, worker_args: tuple[str, ...] = (), scheduler_args: tuple[str, ...] = (),
                     num_workers: int = 1, timeout_s: float = 180.0) -> Iterator[StandaloneServices]:
    """Run `spindle worker`, `spindle scheduler` and `spindle frontend` as separate processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPINDLE_LOG_LEVEL": os.environ.get("SPINDLE_LOG_LEVEL", "WARNING")}
    *worker_ports, scheduler_port, http_port, grpc_port = distinct_free_ports(num_workers + 3)
    workers = [f"127.0.0.1:{port}" for port in worker_ports]
    scheduler = f"127.0.0.1:{scheduler_port}"
    cli = [sys.executable, "-m", "services.cli"]
    commands = [[*cli, "worker", "--model", str(model_dir), "--listen", addr, *worker_args] for addr in workers]
    commands.append([*cli, "scheduler", "--listen", scheduler, "--workers-addr", ",".join(workers), *scheduler_args])
    commands.append([*cli, "frontend", "--model", str(model_dir), "--scheduler-addr", scheduler, "--host",
                     "127.0.0.1", "--port", str(http_port), "--grpc-port", str(grpc_port)])
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env) for cmd in commands]
    server = RunningServer(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", model_dir.name, procs[-1])
    try:
        _wait_healthy(server, timeout_s)
        yield StandaloneServices(server, scheduler, workers, procs)
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (no dependency on ps)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found
