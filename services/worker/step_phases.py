"""`StepPhases`: where a worker's steps spend their time, as counters a scrape reads.

Why: the step histogram says how long a step takes, not why, and on a CPU shared with the host
services the why decides what to work on: the model, the Python around it, or the hand-off of
a step's tokens to the event loop (measured on a 2-core host at 64 streams: 0.5-2.8 ms of an
18-21 ms step in `deliver`, where the event loop thread, woken to send the tokens, took the
compute thread's core while the other OpenMP thread spun on the other one; in process, 0.1 ms).

The compute thread adds each phase's seconds to a plain float: two clock reads and an add per
phase, no lock (prometheus_client's `observe` takes one per call). A collector reads the totals
at scrape time as `spindle:worker_step_phase_seconds_total{phase=...}`; the rate of each, over
the rate of `spindle:worker_step_duration_seconds_sum`, is its share of the step. Phases:

  prepare   the round's setup and each step's inputs (token ids, positions, attention metadata)
  encode    image encoding before step 0 (vision-language models)
  forward   the model's forward pass
  logits    the LM head
  sample    sampling (and structured output's token masks)
  pool      pooling, the head and normalisation, vectors copied to the host (prefill-only models)
  deliver   recording the step's tokens and stops (or vectors), and handing the step to the event loop

A decoder's runner fills prepare through sample; a prefill-only model's (pooling_runner.py)
fills prepare (packing the batch), forward, pool and deliver.

Time between rounds (waiting for the next one) is in no phase. On CUDA the phases time the
host: kernel launches, with the wait for a step's tokens in `deliver`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PHASES = ("prepare", "encode", "forward", "logits", "sample", "pool", "deliver")
METRIC = "spindle:worker_step_phase_seconds"


class StepPhases:
    """Seconds per phase, summed over every step so far; written by the compute thread only."""

    __slots__ = ("totals", "_last")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def start(self) -> None:
        """A round begins: the time since the last mark (between rounds) counts nowhere."""
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the last mark (or `start`) was spent in `phase`."""
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now


class StepPhaseCollector(Collector):
    """Exposes a `StepPhases`' totals as one counter per phase, read when scraped."""

    def __init__(self, phases: StepPhases) -> None:
        self.phases = phases  # replaced by the runner's own once the model is loaded

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(METRIC, "Seconds the worker's steps spent in each phase", labels=["phase"])
        for phase, seconds in dict(self.phases.totals).items():
            family.add_metric([phase], seconds)
        yield family
