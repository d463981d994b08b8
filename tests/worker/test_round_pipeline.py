"""`RoundPipeline`'s hand-off of each step from the compute thread to the event loop: after each
one the compute thread yields its core (round_pipeline.py says why), and only there; the
switch turns it off. Rounds through the real runner and gRPC are in test_worker_servicer.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.worker import round_pipeline
from services.worker.round_pipeline import RoundPipeline
from shared.execute import ExecuteRound

REPO = Path(__file__).resolve().parents[2]


@dataclass
class _Step:
    round_id: int
    index: int

    def to_step_output(self) -> tuple[int, int]:
        return self.round_id, self.index


class _CountingRunner:
    """Delivers `num_steps` steps a round and notes, at each, how many yields came before it."""

    def __init__(self, yields: list[int]) -> None:
        self.yields = yields
        self.seen_before_step: list[int] = []

    def reset(self) -> None:
        pass

    def execute_round(self, round_: ExecuteRound, on_step: Callable[[_Step], None]) -> None:
        for i in range(round_.num_steps):
            self.seen_before_step.append(len(self.yields))
            on_step(_Step(round_.round_id, i))

    def abort(self, request_ids: list[str]) -> None:
        pass


_Run = tuple[list[tuple[int, int]], list[int], _CountingRunner, int]


def _run(monkeypatch: pytest.MonkeyPatch, enabled: bool) -> _Run:
    """Two rounds (3 and 2 steps): their outputs, the thread of each yield, the runner, the loop's thread."""
    yields: list[int] = []
    monkeypatch.setattr(round_pipeline, "YIELD_AFTER_STEP", enabled)
    monkeypatch.setattr(round_pipeline.os, "sched_yield", lambda: yields.append(threading.get_ident()))
    runner = _CountingRunner(yields)

    async def main() -> tuple[list[tuple[int, int]], int]:
        pipeline = RoundPipeline(runner)  # type: ignore[arg-type]

        async def rounds() -> AsyncIterator[ExecuteRound]:
            for round_id, steps in ((0, 3), (1, 2)):
                yield ExecuteRound(round_id=round_id, num_steps=steps)

        try:
            return [out async for out in pipeline.run(rounds())], threading.get_ident()  # type: ignore[misc]
        finally:
            pipeline.close()

    outputs, loop_thread = asyncio.run(main())
    return outputs, yields, runner, loop_thread


def test_the_compute_thread_yields_once_after_each_step_it_hands_on(monkeypatch: pytest.MonkeyPatch) -> None:
    outputs, yields, runner, loop_thread = _run(monkeypatch, enabled=True)
    assert outputs == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert len(yields) == 5, "one yield a step"
    assert runner.seen_before_step == [0, 1, 2, 3, 4], "each right after its step's hand-off"
    assert loop_thread not in yields and len(set(yields)) == 1, "on the compute thread, never the event loop's"


def test_without_the_yield_the_steps_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    outputs, yields, _, _ = _run(monkeypatch, enabled=False)
    assert outputs == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert yields == []


@pytest.mark.parametrize(("value", "expected"), [(None, "True"), ("1", "False")])
def test_the_switch_turns_the_yield_off(value: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPINDLE_DISABLE_STEP_YIELD"}
    if value is not None:
        env["SPINDLE_DISABLE_STEP_YIELD"] = value
    probe = "from services.worker import round_pipeline; print(round_pipeline.YIELD_AFTER_STEP)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == expected
