"""The scheduler's end of a worker's step socket (shared/step_frames.py says why and what).

`stream_steps` runs one Execute stream over the socket (shared/step_dial.py `dial`): rounds
from the outbox go out in order, each step comes back through `on_step`, and it returns why the
stream ended, in the words `WorkerClient` reports for a gRPC stream. `None` in the outbox ends
the scheduler's side (the worker then finishes its rounds and ends with an END frame).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared.execute import AbortRows, ExecuteRound, StepOutput
from shared.execute_wire import execute_request_to_proto, step_from_proto
from shared.pb.spindle.v1 import worker_pb2
from shared.step_dial import StepSocketFallback, dial
from shared.step_frames import HEARTBEAT_INTERVAL_S, SILENCE_TIMEOUT_S

Outgoing = ExecuteRound | AbortRows | None  # None ends the stream

STREAM_CLOSED = "the worker closed its Execute stream"


def _encode(item: ExecuteRound | AbortRows) -> bytes:
    return execute_request_to_proto(item).SerializeToString()


async def stream_steps(host: str, port: int, outbox: asyncio.Queue[Outgoing], on_step: Callable[[StepOutput], None],
                       heartbeat_s: float = HEARTBEAT_INTERVAL_S, silence_timeout_s: float = SILENCE_TIMEOUT_S,
                       fallback: StepSocketFallback | None = None, local_name: str = "") -> str:
    """Run one stream on the worker's local socket `local_name` where it can be reached, else on
    host:port, until it ends (told to `fallback`); why it ended. An exception of `on_step`
    propagates, and StepSocketUnreachableError where no connection could be made (nothing was sent)."""
    ended = await dial(host, port, outbox, _encode,
                       lambda payload: on_step(step_from_proto(worker_pb2.ExecuteResponse.FromString(payload))),
                       "worker", heartbeat_s, silence_timeout_s, fallback, local_name)
    if ended.closed:
        return STREAM_CLOSED
    return ended.why if ended.code is None else f"Execute stream broke ({ended.code.name}: {ended.why})"
