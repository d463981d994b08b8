"""Backpressure: a new request is refused at once while the waiting queues are full.

The queues are bounded in requests and in tokens to prefill (`max_waiting_requests`,
`max_waiting_tokens`), so a burst cannot queue more work than the workers get through before
clients give up. The refusal (RESOURCE_EXHAUSTED, which clients see as HTTP 429 or gRPC
RESOURCE_EXHAUSTED with a retry delay) is the request's first and only update, before any
output. Work already accepted is never refused: a preempted request going back to its queue,
or one a frontend re-submits after a reconnect.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.updates import RequestError
from services.scheduler.worker_state import WorkerState
from shared.errors import ErrorKind


def queue_full_error(workers: Sequence[WorkerState], request: Request, config: SchedulerConfig) -> RequestError | None:
    """Why `request` cannot join the waiting queues now, or None when it can."""
    if request.is_resumed:
        return None
    # Held samples of n > 1 requests count as waiting requests; not their tokens, since they
    # will take the prompt from the prefix cache and prefill little.
    num_requests = sum(len(ws.waiting) + len(ws.held) for ws in workers)
    if num_requests >= config.max_waiting_requests:
        return RequestError(ErrorKind.RESOURCE_EXHAUSTED, (
            f"the server is at capacity: {num_requests} requests are waiting, the limit is "
            f"{config.max_waiting_requests} (max_waiting_requests); retry later"))
    num_tokens = sum(ws.waiting.num_tokens for ws in workers)
    # An empty queue takes any request, however long: otherwise a prompt longer than the
    # limit could never run.
    if num_tokens and num_tokens + request.num_tokens > config.max_waiting_tokens:
        return RequestError(ErrorKind.RESOURCE_EXHAUSTED, (
            f"the server is at capacity: {num_tokens} prompt tokens are waiting and this request adds "
            f"{request.num_tokens}, the limit is {config.max_waiting_tokens} (max_waiting_tokens); retry later"))
    return None
