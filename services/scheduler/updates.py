"""What the scheduler tells a frontend: per-request updates, batched per step and connection.

Mirrors scheduler.proto RequestUpdate / StepUpdates; `wire.py` converts. One `StepUpdates`
per engine step per frontend connection carries every update for that frontend's requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.errors import ErrorKind
from shared.types import StopReason


@dataclass(slots=True, frozen=True)
class RequestError:
    """Why the engine failed a request (the request is then finished)."""

    kind: ErrorKind
    message: str


@dataclass(slots=True)
class RequestUpdate:
    """Everything that happened to one request in one step.

    `token_ids` includes a stop token that ended the request (its id is repeated in
    `stop_token_id`); the frontend decides whether to show it.
    """

    request_id: str
    # Sequences default to () so the per-token hot path allocates one list, not five.
    token_ids: Sequence[int] = ()
    logprobs: Sequence[float] = ()  # one per token, when asked for
    num_top_logprobs: int = 0  # entries per token in top_token_ids / top_logprobs
    top_token_ids: Sequence[int] = ()
    top_logprobs: Sequence[float] = ()
    stop_reason: StopReason | None = None  # set on the last update of a request
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    pooled: Sequence[float] = ()
    error: RequestError | None = None

    @property
    def is_final(self) -> bool:
        return self.stop_reason is not None or self.error is not None


@dataclass(slots=True)
class StepUpdates:
    """One message to one frontend connection."""

    updates: list[RequestUpdate] = field(default_factory=list)
    sampled_unix_ns: int = 0  # from a worker's step: when its tokens reached the worker's host; else 0


class UpdateSink:
    """Collects updates of one step grouped by frontend connection id."""

    __slots__ = ("by_connection",)

    def __init__(self) -> None:
        self.by_connection: dict[int, list[RequestUpdate]] = {}

    def add(self, connection_id: int, update: RequestUpdate) -> None:
        batch = self.by_connection.get(connection_id)
        if batch is None:
            self.by_connection[connection_id] = [update]
        else:
            batch.append(update)

    def __bool__(self) -> bool:
        return bool(self.by_connection)
