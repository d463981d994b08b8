"""Core placement on a CPU host: `spindle serve --cpu-affinity`, and `--cpu-cores` per service.

Workers run torch's OpenMP pool; every parallel op ends at a barrier, so a thread that loses
its core (to another worker, to the frontend or scheduler, or to a migration) stalls all the
others (decode rounds on the native stack use spindle's own pool, which does not wait for a
thread that has not started: kernels/csrc/work_pool.h; its helpers are bound as OpenMP's are).
Placement decides which cores each process may use:

  * off       nothing pinned: the kernel places everything.
  * spread    the workers split the cores (contiguous, as equal as possible), each worker runs
              one torch thread per core of its share, bound to that core (OMP_PLACES); frontend
              and scheduler stay unpinned.
  * isolate   frontend and scheduler get the last core, the workers split the others (one
              thread per core, bound); with fewer cores than workers + 1 it is `spread`.
  * share     `spread`, and frontend and scheduler pinned to the last core, which they share
              with the last worker's last thread (the first thread, which also runs the
              worker's Python, keeps its core to itself).
  * an explicit map: `workers=0-5;host=6-7` (workers split 0-5), or per worker
              `w0=0-2;w1=3-5;host=6` (w<i> for each worker, all or none).
  * auto      the policy that measured best, below.

Measured on a 2-core AMD EPYC (Zen 3, AVX2), fp32, 128 prompt tokens, --num-scheduler-steps 8,
output tokens/s, a fresh server per cell, policies interleaved in each run of `python -m
benchmarks.run --models <m> --concurrency <c> --configs spindle --scheduler-steps 8
--spindle-env-variant off:SPINDLE_CPU_AFFINITY=off --spindle-env-variant
share:SPINDLE_CPU_AFFINITY=share` (2026-11-26; one pair per run, `workers=0-1;host=1` is `share`
on two cores):

  model, streams, output tokens           off                       share
  small, 1 stream, 128 (7 runs)           311 338 395 345 374 322   411 547 410 480 468 340
                                          350                       377
  medium, 1 stream, 128 (2 runs)          53.9 50.9                 56.4 52.5
  medium, 64 streams, 128 (2 runs)        219.5 203.8               247.9 216.1
  small, 16 streams, 128 (2 runs)         1,423 1,268               1,314 1,478
  small, 64 streams, 128 (6 runs)         1,946 2,019 1,928 1,875   1,536 2,062 1,632 1,815
                                          1,647 1,921               2,125 2,012
  medium, 16 streams, 64, --workers 2     64.4 42.8                 140.6 127.5

Unpinned, the host services and the load land on any core, and a worker's first thread (the
one that also runs its Python between parallel ops) loses its core as often as the others;
with `share` only the last thread shares a core, and nothing migrates. One stream of the small
model, where a step is ~1 ms and the services' ~1.5 ms of CPU a token matter most, gains 25 %
on average (every pair, 4-62 %) and its ITL p99 falls from 8.6-10.7 ms to 6.5-8.4; the medium model
gains 3-13 %; two unpinned workers each run two threads on two cores and fight (2-3x slower).
Only the small model at 64 streams, where the services (and the benchmark's own load client)
need most CPU, did not gain: 1,889 against 1,864 on average (-1 %, pairs from -21 % to +29 %),
its ITL p99 no worse (36-55 ms against 46-56). `spread` (the same binding, services unpinned),
in the last two runs: 366 / 356 at one stream, 2,123 / 1,739 at 64. So `auto` is `share`. Older figures (before the
one-call layer stack, slower steps): with one worker, `off`, `spread` and `workers=0-1;host=1`
tied within run-to-run noise. `isolate` halves a 2-core host's decode throughput: the services
need a fraction of a core, the worker loses half its threads. `spread`, `isolate` and maps stay
for hosts where processes must not share cores (other tenants, NUMA).

With --workers N the workers never share a core while there are at least N cores; with fewer,
worker i gets core i mod the number of cores. Pinning uses os.sched_setaffinity on the process
(threads started later inherit it) and, for workers, OMP_PLACES / OMP_PROC_BIND /
OMP_NUM_THREADS in the child's environment, which the OpenMP runtime reads when torch loads it;
a worker started alone with --cpu-cores gets the mask and the thread count but binds its threads
only if those variables are set for it. No torch here: the launcher imports this.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.switches import switch_on

POLICIES = ("off", "spread", "isolate", "share", "auto")


@dataclass(frozen=True, slots=True)
class CorePlan:
    """Cores of each worker and of the host services (frontend, scheduler); () = not pinned."""

    workers: tuple[tuple[int, ...], ...]
    host: tuple[int, ...] = ()

    @property
    def is_pinned(self) -> bool:
        return bool(self.host) or any(self.workers)


def parse_cores(text: str) -> tuple[int, ...]:
    """`0-3,6` -> (0, 1, 2, 3, 6): sorted, distinct; raises ValueError on anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise ValueError(f"bad core list {text!r}: expected e.g. 0-3,6")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if last < first:
            raise ValueError(f"bad core range {part.strip()!r} in {text!r}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cores(cores: Sequence[int]) -> str:
    """The inverse of `parse_cores` for a sorted list: (0, 1, 2, 5) -> `0-2,5`."""
    parts: list[str] = []
    start = prev = None
    for core in [*cores, None]:
        if start is not None and (core is None or core != prev + 1):  # type: ignore[operator]
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if core is not None and start is None:
            start = core
        prev = core
    return ",".join(parts)


def split_cores(cores: Sequence[int], num_workers: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous shares of `cores`, sizes differing by at most one (the first ones larger);
    with fewer cores than workers, worker i gets core i mod len(cores)."""
    if not cores:
        raise ValueError("no cores to place workers on")
    if len(cores) < num_workers:
        return tuple((cores[i % len(cores)],) for i in range(num_workers))
    size, extra = divmod(len(cores), num_workers)
    shares, start = [], 0
    for i in range(num_workers):
        end = start + size + (i < extra)
        shares.append(tuple(cores[start:end]))
        start = end
    return tuple(shares)


AUTO_POLICY = "share"  # what `auto` means: the policy that measured best (above)


def plan_cores(spec: str, num_workers: int, cores: Sequence[int]) -> CorePlan:
    """The placement `spec` (a policy or an explicit map) asks for, on the `cores` this process may use."""
    spec = spec.strip()
    cores = tuple(sorted(cores))
    if spec == "auto":
        spec = AUTO_POLICY
    if spec == "off":
        return CorePlan(((),) * num_workers)
    if spec == "spread":
        return CorePlan(split_cores(cores, num_workers))
    if spec == "share":
        return CorePlan(split_cores(cores, num_workers), cores[-1:])
    if spec == "isolate":
        if len(cores) < num_workers + 1:
            return CorePlan(split_cores(cores, num_workers))
        return CorePlan(split_cores(cores[:-1], num_workers), cores[-1:])
    return _explicit_plan(spec, num_workers, cores)


def _explicit_plan(spec: str, num_workers: int, available: tuple[int, ...]) -> CorePlan:
    entries: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not (key in ("workers", "host") or re.fullmatch(r"w\d+", key)):
            raise ValueError(f"bad --cpu-affinity {spec!r}: expected one of {', '.join(POLICIES)}, or a map "
                             "like workers=0-5;host=6-7 or w0=0-2;w1=3-5;host=6")
        if key in entries:
            raise ValueError(f"--cpu-affinity {spec!r} names {key} twice")
        entries[key] = parse_cores(value)
    missing = sorted(set().union(*entries.values()) - set(available))
    if missing:
        raise ValueError(f"--cpu-affinity {spec!r}: cores {format_cores(missing)} are not available to this process "
                         f"(it may use {format_cores(available)})")
    per_worker = {int(key[1:]): cores for key, cores in entries.items() if key.startswith("w") and key != "workers"}
    if per_worker and "workers" in entries:
        raise ValueError(f"--cpu-affinity {spec!r}: give workers=... or w<i>=... for each worker, not both")
    if per_worker:
        if sorted(per_worker) != list(range(num_workers)):
            raise ValueError(f"--cpu-affinity {spec!r}: name every worker w0..w{num_workers - 1} once")
        workers = tuple(per_worker[i] for i in range(num_workers))
    elif "workers" in entries:
        workers = split_cores(entries["workers"], num_workers)
    else:
        workers = ((),) * num_workers
    return CorePlan(workers, entries.get("host", ()))


def worker_env(cores: Sequence[int]) -> dict[str, str]:
    """Environment for a worker pinned to `cores`: one OpenMP thread per core, each bound to its core."""
    if not cores:
        return {}
    return {
        "OMP_NUM_THREADS": str(len(cores)),
        "OMP_PLACES": ",".join(f"{{{core}}}" for core in cores),
        "OMP_PROC_BIND": "close",
    }


def compute_core(environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """The cores of a pinned worker's first OpenMP place (`worker_env`: OMP_PROC_BIND and
    OMP_PLACES "{c0},{c1},..."), where libgomp binds the thread that runs the model's steps; ()
    where the worker's threads are not bound (no OMP_PROC_BIND) or the places are in another form.

    Why the worker puts its Python threads there (its event loop, gRPC's threads, the compute
    thread; services/worker/service.py `pin_event_loop`): each step's tokens are handed to the
    event loop, which converts and sends them while holding the GIL. Free to run on any core, it
    ran on the last core, beside the OpenMP helper thread, the scheduler and the frontend: taken
    off that core while it held the GIL, it kept the compute thread waiting for the GIL in the
    step's next Python, and it took the helper's core in the middle of the forward pass. On the
    compute thread's core it runs when the compute thread yields after each step
    (round_pipeline.py), and with the default placement nothing else there preempts it (the host
    services are on the last core). A CPU worker only: a CUDA worker's compute thread waits on
    the device, untested here. Measured (2-core AMD EPYC Zen 4, bf16, 128 + 128 tokens, a fresh
    server per run, pairs interleaved, 2026-11-30), output tok/s, free -> compute core: moved by
    `taskset` after start-up, small model one stream 578 / 736 -> 840 / 942, medium one stream
    95.0 / 92.2 -> 98.9 / 100.2 (its step's Python before the forward pass 0.35 / 0.55 -> 0.26 /
    0.26 ms), 64 streams small 4,226 / 4,340 -> 4,220 / 5,166, medium 571 / 675 -> 559 / 655;
    then this code, `python -m benchmarks.run --models small,medium --concurrency 1
    --num-requests 24 --configs spindle --scheduler-steps 8 --spindle-arg=--dtype
    --spindle-arg=bfloat16 --spindle-env-variant free:SPINDLE_DISABLE_EVENT_LOOP_ON_COMPUTE_CORE=1
    --spindle-env-variant core`: small 755 / 680 / 519 / 604 / 531 -> 711 / 754 / 678 / 637 /
    557 (4 of 5 pairs faster, +8 % on average), medium 91.6 / 91.8 -> 97.5 / 90.0.
    SPINDLE_DISABLE_EVENT_LOOP_ON_COMPUTE_CORE=1 leaves them free.
    """
    bind = environ.get("OMP_PROC_BIND", "").strip().lower()
    if not bind or bind.startswith("false") or switch_on("SPINDLE_DISABLE_EVENT_LOOP_ON_COMPUTE_CORE", environ):
        return ()  # libgomp binds nothing (OMP_PROC_BIND=false ignores the places), or switched off
    first = re.fullmatch(r"\{(\d+(?:,\d+)*)\}(?:,.*)?", environ.get("OMP_PLACES", "").strip())
    return tuple(int(c) for c in first.group(1).split(",")) if first else ()


def pin_process(cores: Sequence[int]) -> None:
    """Restrict this process (and the threads it starts from now on) to `cores`."""
    os.sched_setaffinity(0, cores)


def add_cpu_cores_argument(parser: argparse.ArgumentParser) -> None:
    """`--cpu-cores` of a service started alone (or by `spindle serve --cpu-affinity`)."""
    default = os.environ.get("SPINDLE_CPU_CORES")
    parser.add_argument("--cpu-cores", type=parse_cores, default=parse_cores(default) if default else (),
                        help="pin this process to these cores, e.g. 0-3,6 (a worker runs one torch thread per "
                             "core unless --num-threads says otherwise) [SPINDLE_CPU_CORES]")
