"""`spindle serve`'s default core placement (`--cpu-affinity auto`, i.e. `share`) through the real services.

The other e2e modules serve unpinned (tests/e2e/server.py); this one checks that the default
really pins each child where services/cpu_affinity.py says (the worker's event loop on its
compute thread's core), and that a pinned worker, with its OpenMP threads bound, still gives
transformers' greedy tokens to concurrent streams.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from services.cpu_affinity import AUTO_POLICY
from shared.pb.spindle.v1 import generation_pb2_grpc
from tests.e2e.clients import grpc_channel, grpc_generate
from tests.e2e.oracle import greedy_tokens
from tests.e2e.server import spindle_serve

pytestmark = pytest.mark.e2e

PROMPTS = [[1, 5, 9, 13, 17], [1, 100, 7], [1, 42, 42, 42, 8, 3, 250], [1, 77]]


def _children(pid: int) -> dict[str, int]:
    """Service name (worker, scheduler, frontend) -> pid, for the children of `pid`."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited while we looked
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"-m" in cmdline:
            module = cmdline[cmdline.index(b"-m") + 1].decode()
            found[module.removeprefix("services.")] = int(entry)
    return found


def _thread_cores(pid: int) -> list[tuple[int, ...]]:
    """The cores each thread of `pid` may run on."""
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.append(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except OSError:
            continue  # the thread exited while we looked
    return found


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def test_default_placement_pins_every_service_and_keeps_greedy_output(tiny_models: dict[str, Path]) -> None:
    assert AUTO_POLICY == "share"
    cores = sorted(os.sched_getaffinity(0))
    model_dir = tiny_models["llama"]
    with spindle_serve(model_dir, extra_env={"SPINDLE_CPU_AFFINITY": "auto"}) as server:
        children = _children(server.process.pid)
        assert set(children) == {"worker", "scheduler", "frontend"}
        # The worker's main thread runs its event loop, on the compute thread's core (its first place).
        assert sorted(os.sched_getaffinity(children["worker"])) == cores[:1]
        assert sorted(os.sched_getaffinity(children["scheduler"])) == cores[-1:]
        assert sorted(os.sched_getaffinity(children["frontend"])) == cores[-1:]
        env = _environ(children["worker"])
        assert env["OMP_NUM_THREADS"] == str(len(cores))
        assert env["OMP_PLACES"] == ",".join(f"{{{c}}}" for c in cores)
        assert env["OMP_PROC_BIND"] == "close"

        async def generate_all() -> list[list[int]]:
            async with grpc_channel(server.grpc_address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                results = await asyncio.gather(*(grpc_generate(stub, server.model_name, p, 16) for p in PROMPTS))
            return [r.token_ids for r in results]

        got = asyncio.run(generate_all())
        # After requests: the compute thread and the event loop's threads share the first core
        # (libgomp binds the compute thread there), and a bound helper runs on each other core.
        threads = _thread_cores(children["worker"])
        assert threads.count((cores[0],)) >= 3, threads
        assert all((core,) in threads for core in cores[1:]), threads
    assert got == [greedy_tokens(model_dir, p, 16) for p in PROMPTS]
