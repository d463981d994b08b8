"""`HeadScreenCollector`: greedy rows the LM head's int8 screen decided, as a metric a scrape reads.

Why: a greedy step of 1-4 rows reads the LM head through an int8 screen and computes exact
logits only for the rows its error bound leaves in the running (kernels/csrc/head_screen.cpp);
where the bound cannot decide (a NaN or inf in the hidden state, more than 64 rows in the
running) the step reads the full head after all, paying for both. Whether the screen pays on a
served model is the share of rows it decided, which only the kernels know: they count both
outcomes in two atomics, read here at scrape time as
`spindle:worker_head_screen_rows_total{outcome="decided"|"undecided"}`. Nothing is added to
the step; a worker without the CPU kernels exposes no such series.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

METRIC = "spindle:worker_head_screen_rows"  # exposed with _total, as a counter


class HeadScreenCollector(Collector):
    """Reads `torch.ops.spindle.head_screen_counts()` (rows decided, rows left to the full head)."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        decided, undecided = torch.ops.spindle.head_screen_counts()
        family = CounterMetricFamily(METRIC, "Greedy rows whose token the LM head's int8 screen decided, "
                                     "or left to the full head", labels=["outcome"])
        family.add_metric(["decided"], decided)
        family.add_metric(["undecided"], undecided)
        yield family
