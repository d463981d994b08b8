"""Fault-test tools: a real redis-server on loopback, `spindle serve`'s children, and killing them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from shared.ports import free_port, is_free
from tests.e2e.server import descendants


@dataclass
class RedisServer:
    """redis-server with AOF on, in its own process group; `restart` keeps its data directory."""

    port: int
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (Debian package redis-server; make test-packages installs it)"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)

    def restart(self) -> None:
        self.stop()
        self.start()

    def journal_size(self) -> int:
        client = redis.Redis(port=self.port)
        return int(client.hlen("spindle:journal:requests")) + len(client.keys("spindle:journal:output:*"))


@contextlib.contextmanager
def redis_server(data_dir: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), data_dir)
    assert is_free(server.port), f"port {server.port} is taken: a stale server would answer"
    server.start()
    try:
        yield server
    finally:
        server.stop()


def child(launcher_pid: int, module: str, index: int = 0) -> tuple[int, list[str]]:
    """(pid, command line) of `spindle serve`'s `index`-th child running `python -m module`."""
    found = []
    for pid in descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if module in cmdline:
            found.append((pid, cmdline))
    found.sort()
    assert len(found) > index, f"no child {module} #{index} of {launcher_pid}"
    return found[index]


def flag(cmdline: list[str], name: str) -> str:
    return cmdline[cmdline.index(name) + 1]


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
