"""`WorkerLink`: what the engine loop needs from a connection to one worker.

Implemented over gRPC by `worker_client.WorkerClient`; tests and benchmarks may plug in an
in-process fake. Kept apart so the engine loop imports no grpc.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from shared.execute import ExecuteRound, StepOutput, WorkerInfo

OnOutput = Callable[[int, StepOutput], None]  # (worker index, one step's output)
OnFailure = Callable[[int, str], None]  # (worker index, why the link is gone)


class WorkerLink(Protocol):
    address: str

    async def wait_ready(self) -> WorkerInfo:
        """Block until the worker answers GetWorkerInfo."""
        ...

    def open(self, on_output: OnOutput, on_failure: OnFailure) -> None:
        """Start streaming: outputs and a failure arrive through the callbacks, on the event loop."""
        ...

    def send(self, rnd: ExecuteRound) -> None:
        """Queue a round; rounds reach the worker in `send` order."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Queue an abort of requests on the worker, in order with the rounds."""
        ...

    async def reset(self) -> None:
        """Forget a broken stream so the link can `wait_ready` and `open` again."""
        ...

    async def close(self) -> None: ...
