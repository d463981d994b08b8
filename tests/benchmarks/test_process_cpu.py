"""CPU per output token by process (benchmarks/process_cpu.py): a real process group on /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.process_cpu import LOAD_CLIENT, CpuReading, cpu_ms_per, cpu_seconds, read_group, role_of

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


@pytest.mark.parametrize(("argv", "role"), [
    (["/venv/bin/python", "-m", "services.worker", "--model", "m"], "worker"),
    (["python3", "-m", "services.frontend"], "frontend"),
    (["python", "-m", "services.cli", "serve"], "launcher"),
    (["/opt/llama/bin/llama-server", "-m", "model.gguf"], "llama-server"),
    (["/usr/bin/python3.11", "/opt/vllm/entry.py", "--port", "1"], "entry"),
    (["python", "-m", "vllm.entrypoints.openai.api_server"], "vllm"),
    (["python3", "-c", "pass"], "python"),
    ([], "?"),
])
def test_roles_come_from_the_command_line(argv: list[str], role: str) -> None:
    assert role_of(argv) == role


def test_a_busy_process_of_the_group_is_charged_and_an_idle_one_is_not() -> None:
    # A session of its own, as the benchmark starts every server: a shell that starts a busy
    # child and an idle one, all in one process group.
    busy = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    script = f"{sys.executable} -c '{busy}' & exec {sys.executable} -c 'import time; time.sleep(30)'"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    try:
        time.sleep(0.3)  # both started, the busy one burning
        before = read_group(proc.pid)
        assert {role for pid, role in before.roles.items() if pid != os.getpid()} == {"python"}
        assert before.roles[os.getpid()] == LOAD_CLIENT
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = read_group(proc.pid)
            if sum(after.seconds[p] - before.seconds.get(p, 0.0) for p in after.seconds if p != os.getpid()) >= 0.3:
                break
            time.sleep(0.1)
        per_pid = {pid: after.seconds[pid] - before.seconds.get(pid, 0.0) for pid in after.seconds}
        assert per_pid[proc.pid] < 0.05  # the idle one (the shell exec'd into it)
        assert max(per_pid.values()) >= 0.3  # the busy child, ~0.6 s in all
        ms = cpu_ms_per(before, after, count=100)
        assert ms is not None and ms["python"] == pytest.approx(sum(v for p, v in per_pid.items() if p != os.getpid())
                                                             / 100 * 1e3)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_this_process_is_the_load_client_and_no_tokens_means_no_figure() -> None:
    own = cpu_seconds(os.getpid())
    assert own is not None and own > 0
    reading = CpuReading({1: 1.0}, {1: "worker"})
    assert cpu_ms_per(reading, reading, count=0) is None
    assert cpu_ms_per(reading, CpuReading({}, {}), count=10) is None  # no /proc
    later = CpuReading({1: 1.5, 2: 0.2}, {1: "worker", 2: "worker"})  # a second worker started in between
    assert cpu_ms_per(reading, later, count=100) == pytest.approx({"worker": 7.0})
