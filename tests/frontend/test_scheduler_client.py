"""SchedulerClient without a network: batching of adds/aborts, demultiplexing, merging of updates."""

from __future__ import annotations

import asyncio
import time

from services.frontend import wire
from services.frontend.messages import AddRequest
from services.frontend.scheduler_client import SchedulerClient
from shared.pb.spindle.v1 import common_pb2, scheduler_pb2
from shared.sampling import SamplingOptions


def _client() -> tuple[SchedulerClient, asyncio.Queue[scheduler_pb2.ConnectRequest | None]]:
    """A client that looks connected: what it sends lands in the returned queue."""
    client = SchedulerClient("test:0")
    outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None] = asyncio.Queue()
    client._outbox = outbox
    client._info = wire.info_from_proto(scheduler_pb2.GetSchedulerInfoResponse(ready=True, model_id="m"))
    return client, outbox


def _add(request_id: str) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=[5, 6], sampling=SamplingOptions(max_tokens=4))


def _step(*updates: scheduler_pb2.RequestUpdate) -> scheduler_pb2.ConnectResponse:
    return scheduler_pb2.ConnectResponse(step=scheduler_pb2.StepUpdates(updates=updates))


def _sent(outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None]) -> list[scheduler_pb2.ConnectRequest]:
    messages = []
    while not outbox.empty():
        message = outbox.get_nowait()
        assert message is not None
        messages.append(message)
    return messages


async def test_adds_and_aborts_of_one_loop_iteration_leave_as_one_message_each() -> None:
    client, outbox = _client()
    streams = [client.submit(_add(f"r{i}")) for i in range(4)]
    streams[3].close()  # aborted before it was sent: the scheduler never hears of it
    await asyncio.sleep(0)
    [adds] = _sent(outbox)
    assert [r.request_id for r in adds.add.requests] == ["r0", "r1", "r2"]
    streams[0].close()
    streams[1].close()
    await asyncio.sleep(0)
    [aborts] = _sent(outbox)
    assert list(aborts.abort.request_ids) == ["r0", "r1"]
    assert client.num_in_flight == 1


async def test_updates_are_demultiplexed_and_merged_when_the_consumer_lags() -> None:
    client, outbox = _client()
    a, b = client.submit(_add("a")), client.submit(_add("b"))
    await asyncio.sleep(0)  # the adds leave
    client._dispatch(_step(scheduler_pb2.RequestUpdate(request_id="a", token_ids=[7]),
                           scheduler_pb2.RequestUpdate(request_id="b", token_ids=[8]),
                           scheduler_pb2.RequestUpdate(request_id="unknown", token_ids=[9])))
    client._dispatch(_step(scheduler_pb2.RequestUpdate(request_id="a", token_ids=[10],
                                                       stop_reason=common_pb2.STOP_REASON_LENGTH)))
    batch = await anext(a)
    assert [u.token_ids for u in batch] == [[7], [10]]  # two steps, one batch: the consumer catches up
    assert batch[-1].is_final
    assert [u.token_ids for u in await anext(b)] == [[8]]
    a.close()  # finished: no abort needed
    b.close()
    await asyncio.sleep(0)
    assert [list(m.abort.request_ids) for m in _sent(outbox) if m.HasField("abort")] == [["b"]]


async def test_a_deadline_delivers_what_came_before_it_then_times_out_and_close_cancels_it() -> None:
    client, _ = _client()
    loop = asyncio.get_running_loop()
    late = client.submit(_add("late"), deadline=loop.time() + 0.05)
    client._dispatch(_step(scheduler_pb2.RequestUpdate(request_id="late", token_ids=[7])))
    assert [u.token_ids for u in await anext(late)] == [[7]]  # before the deadline: as without one
    client._dispatch(_step(scheduler_pb2.RequestUpdate(request_id="late", token_ids=[8])))
    await asyncio.sleep(0.1)  # read only after the deadline
    assert [u.token_ids for u in await anext(late)] == [[8]]  # it came before the deadline: still delivered
    for _ in range(2):  # then the deadline, however often it is asked
        try:
            await asyncio.wait_for(anext(late), 1.0)
            raise AssertionError("no TimeoutError past the deadline")
        except TimeoutError:
            pass
    late.close()

    waiting = client.submit(_add("waiting"), deadline=loop.time() + 0.05)
    started = loop.time()
    try:
        await anext(waiting)  # nothing comes: the timer ends the wait
        raise AssertionError("no TimeoutError past the deadline")
    except TimeoutError:
        assert 0.04 <= loop.time() - started < 1.0
    waiting.close()

    done = client.submit(_add("done"), deadline=loop.time() + 0.05)
    client._dispatch(_step(scheduler_pb2.RequestUpdate(request_id="done", token_ids=[9],
                                                       stop_reason=common_pb2.STOP_REASON_LENGTH)))
    done.close()  # finished in time: the timer is cancelled
    assert done._timer is not None and done._timer.cancelled()
    assert [u.token_ids for u in await anext(done)] == [[9]]
    await asyncio.sleep(0.1)
    try:
        await anext(done)
        raise AssertionError("the stream went on after its final update")
    except StopAsyncIteration:
        pass


async def test_a_worker_steps_transit_is_reported_and_other_messages_are_not() -> None:
    client, _ = _client()
    transits: list[float] = []
    client.on_step_transit = transits.append
    client.submit(_add("a"))
    client._dispatch(scheduler_pb2.ConnectResponse(step=scheduler_pb2.StepUpdates(
        updates=[scheduler_pb2.RequestUpdate(request_id="a", token_ids=[7])],
        sampled_unix_ns=time.time_ns() - 2_000_000)))  # sampled 2 ms ago
    client._dispatch(_step(scheduler_pb2.RequestUpdate(request_id="a", token_ids=[8])))  # not from a step: no time
    assert len(transits) == 1 and 0.002 <= transits[0] < 1.0


async def test_lost_connection_fails_in_flight_requests_with_unavailable() -> None:
    client, _ = _client()
    stream = client.submit(_add("a"))
    client._fail_all("gone")
    [update] = await anext(stream)
    assert update.error is not None and type(update.error).__name__ == "UnavailableError"


async def test_a_request_that_cannot_be_serialised_fails_alone_and_the_batch_still_leaves() -> None:
    client, outbox = _client()
    bad = _add("bad")
    bad.priority = 2**40  # past int32: validation should have refused it, so the flush must cope
    streams = [client.submit(_add("a")), client.submit(bad), client.submit(_add("b"))]
    await asyncio.sleep(0)
    [adds] = _sent(outbox)
    assert [r.request_id for r in adds.add.requests] == ["a", "b"]
    [update] = await anext(streams[1])
    assert type(update.error).__name__ == "InvalidArgumentError" and "bad" in update.error.message
    assert client.num_in_flight == 2
    streams[1].close()  # already finished: no abort goes out
    await asyncio.sleep(0)
    assert not _sent(outbox)
