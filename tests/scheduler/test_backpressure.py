"""Backpressure: past `max_waiting_requests` / `max_waiting_tokens` a new request is refused at once."""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import RequestUpdate, UpdateSink
from shared.errors import ErrorKind
from shared.sampling import SamplingOptions
from shared.types import RequestKind
from tests.scheduler.fake_worker import FakeWorker


def _make_scheduler(task: RequestKind = RequestKind.GENERATE, **config: int) -> Scheduler:
    worker = FakeWorker(0 if task is not RequestKind.GENERATE else 64, 4, task=task)
    return Scheduler(SchedulerConfig(num_scheduler_steps=1, **config), [worker.info])  # type: ignore[arg-type]


def _add(sched: Scheduler, request_id: str, num_tokens: int,
         kind: RequestKind = RequestKind.GENERATE) -> RequestUpdate | None:
    """Add a request; its immediate update (a refusal), or None when it was queued."""
    sink = UpdateSink()
    sched.add_request(Request(request_id, list(range(4, 4 + num_tokens)), SamplingOptions(max_tokens=4), kind), sink)
    updates = [u for batch in sink.by_connection.values() for u in batch]
    assert len(updates) <= 1
    return updates[0] if updates else None


def _refused(update: RequestUpdate | None, setting: str) -> bool:
    return (update is not None and update.error is not None and update.error.kind is ErrorKind.RESOURCE_EXHAUSTED
            and setting in update.error.message)


def test_full_waiting_queue_refuses_new_requests_until_one_is_admitted() -> None:
    sched = _make_scheduler(max_waiting_requests=2, max_num_seqs=1)
    assert _add(sched, "a", 3) is None and _add(sched, "b", 3) is None
    assert _refused(_add(sched, "c", 3), "max_waiting_requests")
    assert list(sched.requests) == ["a", "b"]  # the refused one left nothing behind
    sched.schedule()  # "a" starts running: one waiting place is free again
    assert _add(sched, "c", 3) is None
    assert _refused(_add(sched, "d", 3), "max_waiting_requests")


def test_waiting_prompt_tokens_are_bounded_but_an_empty_queue_takes_any_prompt() -> None:
    sched = _make_scheduler(max_waiting_tokens=10)
    assert _add(sched, "long", 40) is None  # longer than the limit, but nothing else waits
    assert _refused(_add(sched, "more", 1), "max_waiting_tokens")
    sched.abort_request("long", None)  # leaving the queue returns its tokens
    assert _add(sched, "a", 6) is None
    assert _refused(_add(sched, "b", 5), "max_waiting_tokens")
    assert _add(sched, "c", 4) is None  # exactly at the limit


def test_pooling_requests_count_against_the_waiting_limits() -> None:
    sched = _make_scheduler(RequestKind.EMBED, max_waiting_requests=2)
    assert _add(sched, "e0", 3, RequestKind.EMBED) is None and _add(sched, "e1", 3, RequestKind.EMBED) is None
    assert _refused(_add(sched, "e2", 3, RequestKind.EMBED), "max_waiting_requests")
    sched.schedule()  # both go into a round
    assert _add(sched, "e2", 3, RequestKind.EMBED) is None


def test_a_resubmitted_request_is_never_refused() -> None:
    sched = _make_scheduler(max_waiting_requests=1)
    assert _add(sched, "a", 3) is None
    resumed = Request("b", [4, 5, 6], SamplingOptions(max_tokens=4))
    resumed.is_resumed = True  # accepted before the frontend reconnected: it is not new work
    sink = UpdateSink()
    sched.add_request(resumed, sink)
    assert not sink and "b" in sched.requests
