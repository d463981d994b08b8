"""The scheduler service over gRPC on loopback: fake worker server, real WorkerClient and servicer."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from services.scheduler import wire
from services.scheduler.request import Request
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.updates import RequestUpdate, UpdateSink
from shared.errors import ErrorKind
from shared.pb.spindle.v1 import scheduler_pb2
from shared.sampling import SamplingOptions
from shared.state_store import InMemoryStateStore, JournalBatch
from shared.types import StopReason
from tests.scheduler.fake_worker import reference_output
from tests.scheduler.scheduler_stack import EOS_PERIOD, Stack, make_request, running_stack, until, wait_ready


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with running_stack() as running:
        yield running


async def test_info_reports_ready_once_workers_answer(stack: Stack) -> None:
    info = await wait_ready(stack.stub)
    assert (info.model_id, info.num_workers, info.block_size, info.num_kv_blocks) == ("fake", 2, 4, 64)
    assert info.max_model_len == 128 and info.vocab_size == 64
    assert info.normalizes_embeddings  # frontends leave embeddings' normalisation to it (and its workers)
    assert info.max_request_tokens == 32 * 4 - 3  # pool minus multi-step lookahead slack


async def test_connect_streams_step_updates_and_abort_frees_blocks(stack: Stack) -> None:
    await wait_ready(stack.stub)
    outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[scheduler_pb2.ConnectRequest]:
        while (msg := await outbox.get()) is not None:
            yield msg

    call = stack.stub.Connect(requests())
    prompts = {"a": [5, 6, 7, 8, 9], "b": [10, 11], "c": [12, 13, 14], "long": list(range(20, 40))}
    max_tokens = {"a": 12, "b": 20, "c": 6, "long": 90}
    outbox.put_nowait(wire.add_requests_to_proto([make_request(r, p, max_tokens[r]) for r, p in prompts.items()]))
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    finals: dict[str, RequestUpdate] = {}
    num_messages = 0
    scheduler = stack.engine.scheduler
    assert scheduler is not None
    long_kv = None
    async for msg in call:
        num_messages += 1
        if long_kv is None:
            long_kv = scheduler.workers[scheduler.requests["long"].worker_index or 0].kv
            assert long_kv is not None and long_kv.has_blocks("long")
        seen = [u.request_id for u in msg.step.updates]
        assert len(seen) == len(set(seen)), "one message per step, one update per request"
        for update in map(wire.update_from_proto, msg.step.updates):
            assert update.request_id not in finals, "update after the final one"
            tokens[update.request_id].extend(update.token_ids)
            if update.is_final:
                finals[update.request_id] = update
        if len(tokens["long"]) >= 3 and "long" not in finals and not outbox.qsize():
            outbox.put_nowait(wire.abort_requests_to_proto(["long"]))
        if "long" in finals:
            assert not long_kv.has_blocks("long"), "abort must free blocks at once"
        if len(finals) == len(prompts):
            break
    outbox.put_nowait(None)
    assert finals["long"].stop_reason == StopReason.ABORTED
    for request_id in ("a", "b", "c"):
        assert finals[request_id].stop_reason == StopReason.LENGTH
        assert tokens[request_id] == reference_output(
            prompts[request_id], SamplingOptions(temperature=0.0, max_tokens=max_tokens[request_id]), 128, 64,
            EOS_PERIOD)
    assert num_messages < sum(len(t) for t in tokens.values()), "updates of one step share a message"
    await until(lambda: all(ws.kv is not None and ws.kv.num_free_blocks == ws.kv.num_blocks
                             for ws in scheduler.workers))


async def test_closing_the_stream_aborts_the_frontends_requests(stack: Stack) -> None:
    await wait_ready(stack.stub)
    outbox: asyncio.Queue[scheduler_pb2.ConnectRequest] = asyncio.Queue()

    async def requests() -> AsyncIterator[scheduler_pb2.ConnectRequest]:
        while True:
            yield await outbox.get()

    call = stack.stub.Connect(requests())
    outbox.put_nowait(wire.add_requests_to_proto([make_request("x", [5, 6], 100), make_request("y", [7], 100)]))
    first = await call.read()
    assert first.step.updates
    scheduler = stack.engine.scheduler
    assert scheduler is not None and set(scheduler.requests) == {"x", "y"}
    call.cancel()
    await until(lambda: not scheduler.requests)
    await until(lambda: all(ws.kv is not None and ws.kv.num_free_blocks == ws.kv.num_blocks
                             for ws in scheduler.workers))
    assert scheduler.stats().num_aborted == 2


async def test_half_closed_stream_ends_after_its_requests_finish(stack: Stack) -> None:
    info = await wait_ready(stack.stub)
    too_big = make_request("big", [5] * 10, info.max_request_tokens)
    messages = [wire.add_requests_to_proto([make_request("z", [5, 6, 7], 5), too_big])]
    updates = [wire.update_from_proto(u) async for m in stack.stub.Connect(iter(messages)) for u in m.step.updates]
    by_id: dict[str, list[RequestUpdate]] = {}
    for update in updates:
        by_id.setdefault(update.request_id, []).append(update)
    assert [t for u in by_id["z"] for t in u.token_ids] == reference_output(
        [5, 6, 7], SamplingOptions(temperature=0.0, max_tokens=5), 128, 64, EOS_PERIOD)
    [rejected] = by_id["big"]
    assert rejected.error is not None and rejected.error.kind is ErrorKind.INVALID_ARGUMENT


async def test_failed_worker_moves_its_requests_to_the_live_worker(stack: Stack) -> None:
    await wait_ready(stack.stub)
    scheduler = stack.engine.scheduler
    assert scheduler is not None
    outbox: asyncio.Queue[scheduler_pb2.ConnectRequest] = asyncio.Queue()

    async def requests() -> AsyncIterator[scheduler_pb2.ConnectRequest]:
        while True:
            yield await outbox.get()

    call = stack.stub.Connect(requests())
    outbox.put_nowait(wire.add_requests_to_proto([make_request("p", [5, 6], 100), make_request("q", [7, 8], 100)]))
    tokens: dict[str, int] = {"p": 0, "q": 0}
    finished: dict[str, StopReason] = {}
    msg = await call.read()
    doomed = scheduler.requests["p"].worker_index
    assert doomed is not None and scheduler.requests["q"].worker_index != doomed
    await stack.worker_servers[doomed].stop(0)
    while True:
        for update in map(wire.update_from_proto, msg.step.updates):
            assert update.error is None, update.error
            tokens[update.request_id] += len(update.token_ids)
            if update.stop_reason is not None:
                finished[update.request_id] = update.stop_reason
        if len(finished) == 2:
            break
        msg = await call.read()
    assert finished == {"p": StopReason.LENGTH, "q": StopReason.LENGTH}
    assert tokens == {"p": 100, "q": 100}, "nothing duplicated or missing across the move"
    assert not scheduler.workers[doomed].is_alive and not scheduler.requests
    call.cancel()


async def test_deadline_aborts_a_running_request(stack: Stack) -> None:
    await wait_ready(stack.stub)
    late = make_request("late", [5, 6], 120)  # >= 120 steps x 2 ms: cannot finish before its deadline
    late.deadline_unix_s = time.time() + 0.1
    messages = [wire.add_requests_to_proto([late])]
    updates = [wire.update_from_proto(u) async for m in stack.stub.Connect(iter(messages)) for u in m.step.updates]
    assert updates[-1].stop_reason == StopReason.ABORTED
    assert sum(len(u.token_ids) for u in updates) < 120


async def test_step_messages_carry_the_time_the_worker_sampled_them(stack: Stack) -> None:
    await wait_ready(stack.stub)
    started = time.time_ns()
    messages = [wire.add_requests_to_proto([make_request("timed", [5, 6], 8)])]
    stamps = [m.step.sampled_unix_ns async for m in stack.stub.Connect(iter(messages))]
    assert stamps and all(started <= s <= time.time_ns() for s in stamps)  # every step's, from the worker
    assert stamps == sorted(stamps)


async def test_a_deadline_is_kept_while_nothing_else_wakes_the_scheduler() -> None:
    # Workers that take 2 s a step: no output wakes the loop between steps; its timer must.
    async with running_stack(step_delay_s=2.0) as stack:
        await wait_ready(stack.stub)
        late = make_request("late", [5, 6], 120)
        late.deadline_unix_s = time.time() + 0.3
        started = time.monotonic()
        messages = [wire.add_requests_to_proto([late])]
        async for message in stack.stub.Connect(iter(messages)):
            updates = [wire.update_from_proto(u) for u in message.step.updates]
            if any(u.is_final for u in updates):
                break
        assert updates[-1].stop_reason == StopReason.ABORTED
        assert time.monotonic() - started < 1.5  # at its deadline, not at the next step 2 s on


# ---- the Connect reader: one bad request fails alone; a failing reader ends the stream loudly ----


def _connect(stack: Stack) -> tuple[grpc.aio.StreamStreamCall, asyncio.Queue[scheduler_pb2.ConnectRequest]]:
    outbox: asyncio.Queue[scheduler_pb2.ConnectRequest] = asyncio.Queue()

    async def requests() -> AsyncIterator[scheduler_pb2.ConnectRequest]:
        while True:
            yield await outbox.get()

    return stack.stub.Connect(requests()), outbox


async def _finals(call: grpc.aio.StreamStreamCall, count: int) -> dict[str, RequestUpdate]:
    finals: dict[str, RequestUpdate] = {}
    while len(finals) < count:
        msg = await asyncio.wait_for(call.read(), 10)
        finals.update((u.request_id, u) for u in map(wire.update_from_proto, msg.step.updates) if u.is_final)
    return finals


async def test_a_request_that_cannot_be_read_fails_alone(stack: Stack) -> None:
    await wait_ready(stack.stub)
    call, outbox = _connect(stack)
    message = wire.add_requests_to_proto([make_request("a", [5, 6], 4), make_request("bad", [7], 4),
                                          make_request("b", [8], 4)])
    message.add.requests[1].kind = 99  # a kind this scheduler does not know
    outbox.put_nowait(message)
    finals = await _finals(call, 3)
    assert finals["bad"].error is not None and finals["bad"].error.kind is ErrorKind.INVALID_ARGUMENT
    assert "'bad'" in finals["bad"].error.message
    assert finals["a"].stop_reason is StopReason.LENGTH and finals["b"].stop_reason is StopReason.LENGTH
    call.cancel()


async def test_a_request_that_fails_while_being_added_fails_alone(stack: Stack,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    await wait_ready(stack.stub)
    scheduler = stack.engine.scheduler
    assert scheduler is not None
    add_request = scheduler.add_request

    def add_or_raise(request: Request, sink: UpdateSink) -> None:
        if request.request_id == "boom":
            raise RuntimeError("a bug triggered by this request")
        add_request(request, sink)

    scheduler.add_request = add_or_raise  # type: ignore[method-assign]
    call, outbox = _connect(stack)
    outbox.put_nowait(wire.add_requests_to_proto([make_request("a", [5, 6], 4), make_request("boom", [7], 4),
                                                  make_request("b", [8], 4)]))
    finals = await _finals(call, 3)
    assert finals["boom"].error is not None and finals["boom"].error.kind is ErrorKind.INTERNAL
    assert finals["a"].stop_reason is StopReason.LENGTH and finals["b"].stop_reason is StopReason.LENGTH
    assert "adding request boom failed" in caplog.text
    outbox.put_nowait(wire.add_requests_to_proto([make_request("c", [9], 3)]))  # the stream still serves
    assert (await _finals(call, 1))["c"].stop_reason is StopReason.LENGTH
    call.cancel()


async def test_a_reader_that_fails_ends_the_stream_loudly_and_aborts_its_requests(
        stack: Stack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    await wait_ready(stack.stub)
    scheduler = stack.engine.scheduler
    assert scheduler is not None
    call, outbox = _connect(stack)
    outbox.put_nowait(wire.add_requests_to_proto([make_request("long", [5, 6], 100)]))
    await call.read()  # running

    def broken(*args: object) -> None:
        raise RuntimeError("the reader itself is broken")

    monkeypatch.setattr(SchedulerServicer, "_add", broken)
    with caplog.at_level(logging.ERROR):
        outbox.put_nowait(wire.add_requests_to_proto([make_request("next", [7], 4)]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                await asyncio.wait_for(call.read(), 10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, "the frontend must see the break and reconnect"
    assert "reconnect" in (info.value.details() or "")
    assert "reader failed" in caplog.text
    await until(lambda: not scheduler.requests)  # the connection's requests are aborted, blocks freed


async def test_a_reconnected_frontend_claims_its_journaled_requests_and_the_rest_are_dropped() -> None:
    """After a restart, a frontend's journaled requests it did not re-submit (they finished just
    before the kill, their removal never written) leave the journal as soon as it says it is done,
    not after the orphan timeout; another frontend's stay until it reconnects."""
    store = InMemoryStateStore()
    added = {}
    for request_id, frontend_id in (("kept", "f1"), ("finished", "f1"), ("other", "f2")):
        record = make_request(request_id, [5, 6, 7], 4).to_dict() | {"frontend_id": frontend_id}
        added[request_id] = json.dumps(record).encode()
    await store.write_journal(JournalBatch(added=added))
    async with running_stack(store) as stack:
        await wait_ready(stack.stub)
        assert stack.engine.num_orphans == 3
        outbox: asyncio.Queue[scheduler_pb2.ConnectRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[scheduler_pb2.ConnectRequest]:
            while (msg := await outbox.get()) is not None:
                yield msg

        call = stack.stub.Connect(requests())
        kept = make_request("kept", [5, 6, 7], 4)
        kept.is_resumed, kept.frontend_id = True, "f1"
        outbox.put_nowait(wire.add_requests_to_proto([kept]))
        outbox.put_nowait(scheduler_pb2.ConnectRequest(resubmitted=scheduler_pb2.Resubmitted(frontend_id="f1")))
        async for msg in call:
            if any(u.request_id == "kept" and u.stop_reason for u in msg.step.updates):
                break
        deadline = time.monotonic() + 5
        while set(await store.read_journal()) != {"other"}:
            assert time.monotonic() < deadline, f"journal still holds {set(await store.read_journal())}"
            await asyncio.sleep(0.01)
        assert stack.engine.num_orphans == 1
        outbox.put_nowait(None)
