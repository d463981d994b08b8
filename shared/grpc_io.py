"""Which I/O engine gRPC's core runs the services' sockets on: `SPINDLE_GRPC_EVENT_ENGINE`.

grpcio 1.80+ moves Python's sockets onto gRPC's EventEngine: its own pool of I/O threads
(`event_engine` in top) reads and writes every connection and hands each completed message
to the asyncio poller thread, which hands it to the event loop. A streamed token crosses
three threads in each of the frontend, the scheduler and the worker, and on a small CPU host
every crossing is a wake-up that waits for a core the model's threads are using. With the
EventEngine client and listener experiments off, gRPC's polling runs in the poller thread
itself (its epoll engine) and one crossing goes.

Measured on a 2-core AMD Zen 5 (grpcio 1.85.1), a loopback server stream of 30,000 messages of
120 bytes, CPU per message: receiver 50 -> 19 us, sender 27.5 -> 22.6 us, 49 -> 23 us apart
(/tmp script, not kept). Served, one stream of the small model, three interleaved pairs of
`SPINDLE_GRPC_EVENT_ENGINE=<1|0> python -m benchmarks.peer_bench --peers "" --parts table --models
small --dtypes bfloat16,float32 --concurrency 1` (2-core AMD EPYC Zen 4, 2026-11-30), tok/s
EventEngine -> epoll: bf16 689 / 659 / 684 -> 706 / 763 / 768, fp32 466 / 503 / 602 -> 556 / 540 /
563; CPU per token, scheduler 0.41-0.46 -> 0.37-0.39 ms, frontend 0.28-0.33 -> 0.27-0.28 (bf16).

So epoll is the default (`=1` restores gRPC's EventEngine). It was opt-in for two days after
one full `make test` with it found `spindle serve` not ready within 180 s in a fault test with
the Redis store, which ten runs of that test alone did not repeat; a full clean-clone `.ci/run`
with it on by default passed (1,439 tests, 2026-11-30).

The variable must be read before gRPC's core starts: `services/__init__.py` applies it, which
every service entry point imports first. A GRPC_EXPERIMENTS the operator set is left alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from shared.switches import switch_on

ENV = "SPINDLE_GRPC_EVENT_ENGINE"
LEGACY_POLLING_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def configure_grpc_io(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set GRPC_EXPERIMENTS for `SPINDLE_GRPC_EVENT_ENGINE` (unset, "" or 0: gRPC's epoll polling
    in its poller thread; anything else: gRPC's default EventEngine, read as the SPINDLE_DISABLE_*
    switches are); returns what it set, None if nothing."""
    if switch_on(ENV, environ) or "GRPC_EXPERIMENTS" in environ:
        return None
    environ["GRPC_EXPERIMENTS"] = LEGACY_POLLING_EXPERIMENTS
    return LEGACY_POLLING_EXPERIMENTS
