"""How long OpenMP's threads spin after a parallel op, chosen by model kind before torch loads.

libgomp (torch's OpenMP runtime on Linux) keeps a thread that has finished its share of a
parallel op spinning for GOMP_SPINCOUNT iterations before it sleeps, 300,000 by default:
milliseconds on a small host. That suits a decode stream, whose next op comes microseconds later.
A prefill-only model (embeddings, scores) runs one forward pass per batch and then has nothing
for its threads to do, while the worker's event loop, the scheduler and the frontend need a core
to send the result on: with the default, the spinning threads compete with them for both cores of
a 2-core host for up to milliseconds after every forward pass.

So for a prefill-only model the worker sets GOMP_SPINCOUNT=10000, unless GOMP_SPINCOUNT or
OMP_WAIT_POLICY is set already (the operator's choice wins). Decoders keep the default: one
stream of the small model lost 2-6 % with 10,000 (two interleaved pairs, 746 / 751 -> 732 / 709
output tok/s), and 64 streams gained (4,431 / 4,811 / 4,673 -> 4,871 / 5,166 / 4,811) but within
the host's noise.

Measured on a 2-core AMD EPYC Zen 4 (2026-11-29), all-MiniLM-L6-v2 served, runs interleaved.
`python -m benchmarks.embed_bench --concurrency 1 --configs spindle` (one sentence per request),
seven pairs, sentences/s:

    default (300,000)   49.3 49.9 42.4 43.0 44.9 44.0 44.9   mean 45.5, worker idle 27-30 %
    10,000              52.2 44.9 48.1 48.6 54.0 51.5 54.5   mean 50.5 (+11 %, 6 of 7 pairs), idle 23-25 %

and at 32 concurrent requests, where the worker never waits, a tie (`--concurrency 32`, two pairs:
80.1 / 86.1 against 85.1 / 83.2). The spin count swept on one 110-token input at a time (40
requests a run, client latency p50 in ms, a /tmp script, the variable set by hand):

    GOMP_SPINCOUNT   300,000 (default)   100,000   30,000        10,000              3,000         1,000
    p50 (ms)         24.5 25.3           21.8      19.5 21.9     19.7 16.4 19.7      21.4 19.4     22.5 23.8

1,000 is too short: the threads then sleep between the ops of one forward pass, and each op
waits for a wake-up.

libgomp reads the variable once, when torch loads it, so the worker's entry point calls this
before anything imports torch.
"""

from __future__ import annotations

import logging
import os
import sys

from services.worker.models import is_prefill_only, read_hf_config

logger = logging.getLogger(__name__)

PREFILL_ONLY_SPIN_COUNT = 10_000
# Any of these set by the operator: leave OpenMP's waiting alone.
WAIT_POLICY_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def configure_openmp_wait(model_dir: str) -> int | None:
    """Set GOMP_SPINCOUNT for a prefill-only model; the spin count set, or None if left alone.

    A model directory that cannot be read is left to the worker's loader, which reports it.
    """
    if any(name in os.environ for name in WAIT_POLICY_VARIABLES):
        return None
    try:
        architectures = read_hf_config(model_dir).get("architectures") or []
    except (OSError, ValueError):
        return None
    if not architectures or not is_prefill_only(architectures[0]):
        return None
    if "torch" in sys.modules:
        logger.warning("torch is loaded already: GOMP_SPINCOUNT=%d would not take effect; not set",
                       PREFILL_ONLY_SPIN_COUNT)
        return None
    os.environ["GOMP_SPINCOUNT"] = str(PREFILL_ONLY_SPIN_COUNT)
    logger.info("prefill-only model: OpenMP threads spin %d iterations after a parallel op, then sleep",
                PREFILL_ONLY_SPIN_COUNT)
    return PREFILL_ONLY_SPIN_COUNT
