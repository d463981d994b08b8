"""Start `spindle serve` as a real process tree for end-to-end tests, and stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class RunningServer:
    http_url: str  # e.g. http://127.0.0.1:8123
    grpc_address: str  # e.g. 127.0.0.1:50123
    model_name: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def spindle_serve(model_dir: Path, *extra_args: str, timeout_s: float = 180.0) -> Iterator[RunningServer]:
    """Run `spindle serve` on free loopback ports until the block ends, then SIGTERM it."""
    http_port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(http_port), "--grpc-port", str(grpc_port), *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPINDLE_LOG_LEVEL": os.environ.get("SPINDLE_LOG_LEVEL", "WARNING")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE)
    server = RunningServer(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", model_dir.name, proc)
    try:
        _wait_healthy(server, timeout_s)
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError("spindle serve did not stop within 30 s of SIGTERM") from None


def _wait_healthy(server: RunningServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"spindle serve exited early with code {server.process.returncode}")
        try:
            with urllib.request.urlopen(server.http_url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"spindle serve not healthy after {timeout_s} s")
