"""SIGTERM to `spindle serve` with streams in flight: every one of them still finishes, exactly.

The launcher stops frontend and scheduler first, which refuse new work and let the requests in
flight finish, and the workers only after them; so a shutdown loses nothing and each stream
still equals transformers' greedy output.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.e2e.server import spindle_serve
from tests.e2e.test_faults import run_with_fault
from tests.e2e.test_scheduler_pressure import assert_matches_oracle, jobs_for

pytestmark = pytest.mark.e2e


def test_sigterm_lets_every_stream_in_flight_finish(tiny_models: dict[str, Path]) -> None:
    model = tiny_models["llama"]
    jobs = [(prompt, 300 + max_tokens) for prompt, max_tokens in jobs_for(43, count=12, max_out=100)]
    # Two at a time, so draining takes seconds: longer than a worker's own gRPC stop grace (5 s).
    with spindle_serve(model, "--shutdown-grace-s", "40", "--max-num-seqs", "2") as server:
        results = run_with_fault(server, jobs, lambda: os.kill(server.process.pid, signal.SIGTERM))
        assert server.process.wait(timeout=60) == 0, "spindle serve exits cleanly once drained"
    assert all(r.finish_reason in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH") for r in results), results
    assert_matches_oracle(model, jobs, results)
