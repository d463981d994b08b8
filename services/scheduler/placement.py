"""`choose_worker`: which data-parallel worker a new request goes to.

A prefix-cache hit saves the prompt's prefill, but sending every request with a shared
system prompt to the one worker that has it cached leaves the others idle. So the worker
with the longest hit wins only while the load stays balanced: when its live requests exceed
the least loaded worker's by more than `allowed_imbalance` (a few requests plus a quarter),
the least loaded takes the request instead and, computing the prompt once, caches the
shared prefix there too. Later requests then find hits on both and ties go to the least
loaded, so a shared prompt ends up spread evenly (SGLang's cache-aware router balances the
same way). Placement is final: a preempted request resumes on the same worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.request import Request
from services.scheduler.worker_state import WorkerState


def allowed_imbalance(least_load: int) -> int:
    """How many more live requests than the least loaded worker a prefix hit may justify."""
    return 2 + least_load // 4


def choose_worker(workers: Sequence[WorkerState], request: Request) -> WorkerState | None:
    alive = [ws for ws in workers if ws.is_alive]
    if not alive:
        return None
    hits = {ws.index: _num_hit_blocks(ws, request) for ws in alive}
    best_hit = min(alive, key=lambda ws: (-hits[ws.index], ws.load, ws.index))
    least_loaded = min(alive, key=lambda ws: (ws.load, -hits[ws.index], ws.index))
    if best_hit.load - least_loaded.load > allowed_imbalance(least_loaded.load):
        return least_loaded
    return best_hit


def _num_hit_blocks(ws: WorkerState, request: Request) -> int:
    if ws.kv is None or not request.is_generate:
        return 0
    return ws.kv.get_computed_blocks(request)[1]
