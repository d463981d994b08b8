"""`choose_worker`: which data-parallel worker a new request goes to.

The live worker holding the longest prefix-cache hit for the prompt wins (its KV is reused);
ties go to the least loaded (fewest live requests), then the lowest index. Placement is
final: a preempted request resumes on the same worker, where its prefix is cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.request import Request
from services.scheduler.worker_state import WorkerState


def choose_worker(workers: Sequence[WorkerState], request: Request) -> WorkerState | None:
    best: WorkerState | None = None
    best_key: tuple[int, int, int] | None = None
    for ws in workers:
        if not ws.is_alive:
            continue
        num_hit = 0
        if ws.kv is not None and request.is_generate:
            num_hit = ws.kv.get_computed_blocks(request)[1]
        key = (-num_hit, ws.load, ws.index)
        if best_key is None or key < best_key:
            best, best_key = ws, key
    return best
