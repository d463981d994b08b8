"""Run `spindle serve` for one timed benchmark configuration, with every core available to it.

Reuses the e2e harness's port picking, handle and health wait (tests/e2e/server.py). It differs
from `spindle_serve` there in two ways a benchmark needs: the services get all cores
(`OMP_NUM_THREADS`) instead of the one the tests pin, and their output goes to a log file kept
next to the results rather than a pipe nobody reads. `extra_env` reaches every service, which is
how a benchmark sets service flags `spindle serve` does not expose (their SPINDLE_* defaults).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from shared.ports import distinct_free_ports
from tests.e2e.server import RunningServer, _wait_healthy

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def spindle_server(model_dir: Path, *extra_args: str, num_threads: int, log_path: Path,
                   timeout_s: float = 600.0, extra_env: Mapping[str, str] | None = None,
                   tree: Path = REPO) -> Iterator[RunningServer]:
    """`spindle serve --model model_dir *extra_args` on free loopback ports until the block ends.

    `extra_env` is added to the environment of the launcher and so of every service it starts,
    e.g. {"SPINDLE_ENABLE_PREFIX_CACHING": "false"} for the scheduler. `tree`: the source tree the
    services run from (another revision's worktree, for a side-by-side comparison).

    Raises AssertionError (from the harness) if the server exits or is not healthy in `timeout_s`.
    """
    http_port, grpc_port = distinct_free_ports(2)
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(http_port), "--grpc-port", str(grpc_port), *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(num_threads),
           "SPINDLE_LOG_LEVEL": os.environ.get("SPINDLE_LOG_LEVEL", "INFO"), **(extra_env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        logger.info("starting: %s (log %s)", " ".join(cmd[1:]), log_path)
        # Own session: if the launcher hangs, its whole group (the services it started) can be killed.
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = RunningServer(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", model_dir.name, proc)
        try:
            _wait_healthy(server, timeout_s)
            yield server
        finally:
            stop_server(proc, "spindle serve")


def stop_server(proc: subprocess.Popen[bytes], label: str, *, signal_group: bool = False) -> None:
    """SIGTERM, then SIGKILL the process group after 30 s.

    `signal_group=False` signals only the process (spindle's launcher stops its own services);
    True signals its whole group at once (vLLM runs its engine in a child that must stop too).
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if signal_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        logger.warning("%s (pid %d) ignored SIGTERM for 30 s; killing its process group", label, proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
