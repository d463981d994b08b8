"""Deadlines: a gRPC deadline or the frontend's request timeout, whichever is sooner, aborts the request
(and reaches the scheduler as its deadline, so its blocks are freed even without the frontend)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from services.frontend.server import Frontend
from shared.pb.spindle.v1 import common_pb2, generation_pb2_grpc
from shared.pb.spindle.v1 import generation_pb2 as pb
from tests.frontend.conftest import MODEL_NAME, make_config
from tests.frontend.fake_scheduler import FakeScheduler

Stub = generation_pb2_grpc.GenerationServiceStub
SLOW = 0.05  # seconds per fake step: 100 tokens take 5 s


@pytest.fixture
def fake() -> FakeScheduler:
    return FakeScheduler(step_interval_s=SLOW)


def _long_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_tokens=100))


async def test_grpc_deadline_aborts_the_request_and_becomes_its_scheduler_deadline(
        stub: Stub, fake: FakeScheduler) -> None:
    sent = time.time()
    responses: list[pb.GenerateResponse] = []
    try:
        responses += [r async for r in stub.Generate(_long_request(), timeout=0.5)]
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:  # the frontend's timer (the same deadline) ended the stream a moment before gRPC did
        assert responses[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    assert sent < fake.added[0].deadline_unix_s <= sent + 0.5 + 0.05, "the client's deadline, not the 600 s timeout"
    assert await fake.wait_for_abort() == [fake.added[0].request_id]
    assert not fake.running


async def test_without_a_client_deadline_the_request_timeout_applies(stub: Stub, fake: FakeScheduler) -> None:
    before = time.time()
    [*_, last] = [r async for r in stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text="hi"), timeout=60)]
    assert last.HasField("complete")
    assert before + 59 < fake.added[0].deadline_unix_s <= time.time() + 60  # the client's 60 s beat 600 s
    [*_, last] = [r async for r in stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text="hi"))]
    assert fake.added[1].deadline_unix_s > before + 599


@pytest.fixture
async def impatient(tokenizer_dir: Path, fake: FakeScheduler, scheduler_addr: str) -> AsyncIterator[Frontend]:
    """A frontend whose request timeout (0.3 s) is shorter than the clients' deadlines."""
    server = Frontend(make_config(tokenizer_dir, scheduler_addr, request_timeout_s=0.3))
    await server.start()
    await server.scheduler.wait_ready(10)
    yield server
    await server.stop(0)


async def test_a_request_timeout_shorter_than_the_deadline_ends_the_stream_as_aborted(
        impatient: Frontend, fake: FakeScheduler) -> None:
    async with grpc.aio.insecure_channel(impatient.grpc_address) as channel:
        responses = [r async for r in Stub(channel).Generate(_long_request(), timeout=30)]
    assert responses[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    assert 0 < responses[-1].complete.usage.completion_tokens < 100
    assert fake.added[0].deadline_unix_s < time.time() + 1
    assert await fake.wait_for_abort() == [fake.added[0].request_id]


@pytest.mark.parametrize("fake", [FakeScheduler(task=common_pb2.REQUEST_KIND_EMBED, step_interval_s=2.0)],
                         ids=["embed-model"])
async def test_pooling_past_its_deadline_is_deadline_exceeded(impatient: Frontend, fake: FakeScheduler) -> None:
    async with grpc.aio.insecure_channel(impatient.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await Stub(channel).Embed(pb.EmbedRequest(inputs=["a", "b"]), timeout=30)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline of 0.3 s" in (info.value.details() or "")
    assert all(0 < add.deadline_unix_s < time.time() + 1 for add in fake.added)
    async with aiohttp.ClientSession() as session, \
            session.post(f"http://{impatient.http_address}/v1/embeddings", json={"input": "a"}) as resp:
        assert resp.status == 504 and (await resp.json())["error"]["type"] == "timeout_error"
