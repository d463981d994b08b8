"""`spindle serve` stops its children in an order that lets requests drain.

Frontend and scheduler get SIGTERM first and drain; the workers keep running until both have
exited (the requests draining run on them), and a child that ignores SIGTERM is killed once its
grace period is over, after it was asked to write its threads' stacks. The children here are
small Python processes that log their signals.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import launcher as launcher_module
from services.launcher import Launcher, ServeConfig

# Logs "term <t>" on SIGTERM, then "exit <t>" after DRAIN_S (or never exits with IGNORE); writes its
# stacks to <log>.stacks on the stack-dump signal, as services/cli.py has the services do on stderr.
CHILD = """
import faulthandler, signal, sys, time
log, drain_s = sys.argv[1], float(sys.argv[2])
faulthandler.register(signal.SIGUSR1, file=open(log + ".stacks", "w"), all_threads=True)
def note(what):
    with open(log, "a") as f:
        f.write(f"{what} {time.time()}\\n")
def on_term(*_):
    note("term")
    if drain_s < 0:
        return
    time.sleep(drain_s)
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
note("ready")
while True:
    time.sleep(0.01)
"""


def _events(log: Path) -> dict[str, float]:
    return {line.split()[0]: float(line.split()[1]) for line in log.read_text().splitlines()}


def _launcher(tmp_path: Path, drains: dict[str, float], grace_s: float = 5.0) -> Launcher:
    launcher = Launcher(ServeConfig(model=str(tmp_path), shutdown_grace_s=grace_s))
    for name, drain_s in drains.items():
        launcher.children[name] = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / name), str(drain_s)])
    deadline = time.monotonic() + 20
    while not all((tmp_path / name).exists() for name in drains):
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.02)
    return launcher


def test_workers_are_stopped_only_after_frontend_and_scheduler_drained(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, {"frontend": 0.6, "scheduler": 0.3, "worker-0": 0.0, "worker-1": 0.0})
    launcher.stop()
    frontend, scheduler = _events(tmp_path / "frontend"), _events(tmp_path / "scheduler")
    assert abs(frontend["term"] - scheduler["term"]) < 0.5, "frontend and scheduler drain together"
    for worker in ("worker-0", "worker-1"):
        assert _events(tmp_path / worker)["term"] >= max(frontend["exit"], scheduler["exit"]), worker
    assert all(proc.returncode == 0 for proc in launcher.children.values())


def test_a_child_that_ignores_sigterm_is_killed_after_its_grace(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_module, "STOP_MARGIN_S", 0.2)
    launcher = _launcher(tmp_path, {"frontend": -1, "scheduler": 0.0, "worker-0": 0.0}, grace_s=0.3)
    start = time.monotonic()
    launcher.stop()
    assert 0.5 <= time.monotonic() - start < 5
    assert launcher.children["frontend"].returncode == -9
    assert "most recent call first" in (tmp_path / "frontend.stacks").read_text(), "its stacks, before the kill"
    assert (tmp_path / "scheduler.stacks").read_text() == "", "a child that stopped is not asked"
    assert "term" in _events(tmp_path / "worker-0"), "the workers are still stopped gently"
