"""The service flags `spindle serve` takes and hands, unchanged, to the children that read them.

One table instead of one hand-written line per flag: each entry names the flag, the services
that take it and its help. `spindle serve` adds every entry with no default, so a flag left
unset is not passed at all and each child keeps its own default, or its SPINDLE_* variable
(children inherit the environment). The frontend's request limits come straight from
`RequestLimits`, so a limit added there reaches `spindle serve` with no change here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from services.frontend.config import FrontendConfig
from services.frontend.limits import RequestLimits
from services.scheduler.config import SchedulerConfig

FRONTEND, SCHEDULER, WORKER = "frontend", "scheduler", "worker"


@dataclass(frozen=True, slots=True)
class ServeFlag:
    """`--{name}` (underscores as dashes) of type `kind`, handed to each of `services`."""

    name: str
    services: tuple[str, ...]
    kind: Callable[[str], object]
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SERVE_FLAGS: tuple[ServeFlag, ...] = (
    # Batching: the scheduler plans with the same limits the worker sizes its buffers for.
    ServeFlag("max_num_seqs", (WORKER, SCHEDULER), int, "most sequences running at once"),
    ServeFlag("max_num_batched_tokens", (WORKER, SCHEDULER), int, "token budget per step"),
    ServeFlag("num_scheduler_steps", (SCHEDULER,), int, "decode steps per scheduler round trip (multi-step)"),
    ServeFlag("round_target_ms", (SCHEDULER,), float,
              "while steps are short, a round runs as many steps as take about this long (0: never)"),
    # Backpressure.
    ServeFlag("max_waiting_requests", (SCHEDULER,), int,
              "most requests waiting for admission; past it new ones get HTTP 429 / RESOURCE_EXHAUSTED"),
    ServeFlag("max_waiting_tokens", (SCHEDULER,), int,
              "most prompt tokens waiting for admission; past it new requests get HTTP 429 / RESOURCE_EXHAUSTED"),
    # The model on the worker.
    ServeFlag("attention_backend", (WORKER,), str, "auto | paged | sdpa | naive | flash-attn"),
    ServeFlag("dtype", (WORKER,), str, "auto | float32 | bfloat16 | float16"),
    ServeFlag("weight_dtype", (WORKER,), str,
              "auto | float32 | bfloat16: linear weights' storage (bfloat16 with float32 activations on CPU)"),
    ServeFlag("kv_cache_dtype", (WORKER,), str,
              "auto | float32 | bfloat16 | float16: the KV cache's storage (16-bit with float32 activations on "
              "CPU paged attention: twice the tokens in the same budget)"),
    ServeFlag("encoder_matmul", (WORKER,), str,
              "auto | float32 | bfloat16: inputs of an embedding or cross-encoder model's GEMMs (CPU, float32 "
              "activations); auto: bfloat16 for embedding models on a CPU with bf16 math"),
    ServeFlag("device", (WORKER,), str, "auto | cpu | cuda"),
    ServeFlag("kv_cache_bytes", (WORKER,), int, "KV cache budget per CPU worker"),
    ServeFlag("step_transport", (FRONTEND, SCHEDULER), str,
              "socket | grpc: stream steps on the step sockets of the scheduler and the workers (default) or "
              "on gRPC's Connect and Execute"),
    ServeFlag("block_size", (WORKER,), int, "tokens per KV block"),
    ServeFlag("num_threads", (WORKER,), int, "torch threads per worker"),
    # Nothing lost: the journal, failover, drain, per-key rate limits.
    ServeFlag("state_store", (FRONTEND, SCHEDULER), str,
              "memory, or redis://host:port/db: the scheduler journals accepted requests there (a restarted "
              "scheduler carries them on) and frontends count per-key rate limits there"),
    ServeFlag("orphan_timeout_s", (SCHEDULER,), float,
              "after a scheduler restart, journaled requests wait this long for their frontend"),
    ServeFlag("max_worker_failures", (SCHEDULER,), int,
              "a request on this many failing workers fails alone; others move"),
    ServeFlag("shutdown_grace_s", (FRONTEND, SCHEDULER), float,
              "on SIGTERM, requests in flight get this long to finish"),
    ServeFlag("rate_limit_rpm", (FRONTEND,), int, "requests per minute per API key; 0: no limit"),
    # Requests.
    ServeFlag("default_max_tokens", (FRONTEND,), int, "max_tokens of a request that leaves it unset"),
    ServeFlag("request_timeout_s", (FRONTEND,), float, "abort requests running longer than this; 0: never"),
    *(ServeFlag(limit.name, (FRONTEND,), int, limit.metadata["help"]) for limit in fields(RequestLimits)),
)


def add_serve_flags(parser: argparse.ArgumentParser, flags: Sequence[ServeFlag] = SERVE_FLAGS) -> None:
    """Every flag of `flags`, unset by default (the child's own default and SPINDLE_* variable apply)."""
    for f in flags:
        parser.add_argument(f.flag, dest=f.name, type=f.kind, default=None, help=f"{f.help} ({', '.join(f.services)})")


def service_args(args: argparse.Namespace, service: str, flags: Sequence[ServeFlag] = SERVE_FLAGS) -> tuple[str, ...]:
    """`--flag value` for each flag of `flags` that `service` takes and the command line set."""
    out: list[str] = []
    for f in flags:
        value = getattr(args, f.name)
        if service in f.services and value is not None:
            out += [f.flag, str(value)]
    return tuple(out)


def shutdown_grace_s(args: argparse.Namespace) -> float:
    """How long frontend and scheduler will drain on SIGTERM: what `--shutdown-grace-s` hands them,
    else what they read from SPINDLE_SHUTDOWN_GRACE_S, else the longer of their defaults."""
    if args.shutdown_grace_s is not None:
        return float(args.shutdown_grace_s)
    if os.environ.get("SPINDLE_SHUTDOWN_GRACE_S"):
        return float(os.environ["SPINDLE_SHUTDOWN_GRACE_S"])
    return max(_default(FrontendConfig, "shutdown_grace_s"), _default(SchedulerConfig, "shutdown_grace_s"))


def _default(config: type, name: str) -> float:
    return float(next(f.default for f in fields(config) if f.name == name))
