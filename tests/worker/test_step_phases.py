"""Step phase counters (services/worker/step_phases.py): what they add up, and what a scrape shows."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.worker import step_phases
from services.worker.step_phases import PHASES, StepPhases
from services.worker.telemetry import WorkerMetrics
from tests.worker.worker_harness import ToyScheduler, make_runner


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _scraped(metrics: WorkerMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {s.labels["phase"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "spindle:worker_step_phase_seconds_total"}


def test_marks_add_the_time_since_the_last_mark_and_start_skips_the_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(step_phases.time, "perf_counter", clock)
    phases = StepPhases()
    clock.now += 5.0  # before the first round: counted nowhere
    phases.start()
    clock.now += 0.25
    phases.mark("prepare")
    clock.now += 1.5
    phases.mark("forward")
    clock.now += 0.5
    phases.mark("forward")
    clock.now += 7.0  # between rounds
    phases.start()
    clock.now += 0.125
    phases.mark("deliver")
    assert phases.totals == {"prepare": 0.25, "encode": 0.0, "forward": 2.0, "logits": 0.0, "sample": 0.0,
                             "pool": 0.0, "deliver": 0.125}


def test_a_scrape_shows_every_phase_and_then_the_runners_totals() -> None:
    metrics = WorkerMetrics()
    assert _scraped(metrics) == dict.fromkeys(PHASES, 0.0)  # exposed before a model is loaded
    phases = StepPhases()
    phases.totals["forward"] = 3.5
    metrics.report_step_phases(phases)
    assert _scraped(metrics)["forward"] == 3.5
    phases.totals["forward"] = 4.0  # read at scrape time, not copied
    assert _scraped(metrics)["forward"] == 4.0


def test_a_runners_steps_fill_their_phases(llama_dir: Path) -> None:
    runner = make_runner(llama_dir)
    toy = ToyScheduler(runner, num_blocks=64, block_size=16, num_steps=4)
    toy.add("a", list(range(3, 40)), max_tokens=9)
    toy.add("b", list(range(5, 20)), max_tokens=6)
    start = time.perf_counter()
    toy.run()
    wall = time.perf_counter() - start
    totals = runner.phases.totals
    assert set(totals) == set(PHASES)
    assert all(totals[p] > 0 for p in ("prepare", "forward", "logits", "sample", "deliver")), totals
    assert totals["encode"] == totals["pool"] == 0.0  # no images; a decoder pools nothing
    assert sum(totals.values()) <= wall  # the toy scheduler's own time between rounds is in no phase
