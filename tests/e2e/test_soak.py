"""`make soak`'s script, run briefly: it serves, loads, settles, checks and reports as it should.

Ten seconds and 16 streams on the tiny Llama instead of ten minutes and 256 on the benchmark
model; every check must pass and every kind of request (completed, aborted, rejected) must have
been sent over both protocols.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import REPO

pytestmark = pytest.mark.e2e

def test_short_soak_passes_every_check(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.soak", "--model-dir", str(tiny_models["llama"]),
           "--duration-s", "10", "--warmup-s", "2", "--streams", "16", "--progress-s", "4", "--settle-s", "20",
           "--abort-fraction", "0.3", "--invalid-fraction", "0.15",
           "--out-dir", str(tmp_path)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "[soak " in run.stdout, "progress lines are printed while the load runs"
    assert "soak PASSED" in run.stdout
    summary = json.loads(next(tmp_path.glob("soak-*.json")).read_text())
    assert all(check["ok"] for check in summary["checks"])
    names = {check["name"] for check in summary["checks"]}
    assert {"kv blocks", "open requests", "errors", "processes", "server log", "rss frontend", "rss scheduler",
            "rss worker-0"} <= names
    by_protocol = summary["requests_by_protocol"]
    for protocol in ("grpc", "http-completion"):
        for kind in ("completed", "aborted", "rejected"):
            assert by_protocol.get(f"{protocol} {kind}", 0) > 0, (protocol, kind, by_protocol)
    assert summary["tokens_per_s"] > 0
    assert next(tmp_path.glob("soak-*.log")).stat().st_size > 0, "the server's log is kept"
