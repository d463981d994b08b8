"""A scheduler at capacity refuses a request before its stream starts: HTTP 429 with Retry-After, gRPC
RESOURCE_EXHAUSTED with a `retry-after` trailer; other requests are untouched."""

from __future__ import annotations

import aiohttp
import grpc
import openai
import pytest

from services.frontend.server import Frontend
from shared.pb.spindle.v1 import common_pb2, generation_pb2_grpc, scheduler_pb2
from shared.pb.spindle.v1 import generation_pb2 as pb
from tests.frontend.conftest import MODEL_NAME
from tests.frontend.fake_scheduler import FakeScheduler

FULL = "the server is at capacity: 4096 requests are waiting (max_waiting_requests); retry later"


def _refuse_marked(add: scheduler_pb2.AddRequest) -> common_pb2.RequestError | None:
    """Refuse the requests whose prompt holds token 13, as a full scheduler refuses new ones."""
    if 13 in add.prompt_token_ids:
        return common_pb2.RequestError(kind=common_pb2.ERROR_KIND_RESOURCE_EXHAUSTED, message=FULL)
    return None


@pytest.fixture
def fake() -> FakeScheduler:
    return FakeScheduler(error_for=_refuse_marked)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_http_answers_429_with_retry_after_before_any_output(frontend: Frontend, stream: bool) -> None:
    url = f"http://{frontend.http_address}/v1/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={"prompt": [13, 20], "max_tokens": 4, "stream": stream}) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"
            error = (await resp.json())["error"]
        assert (error["type"], error["code"], error["message"]) == ("rate_limit_error", 429, FULL)
        async with session.post(url, json={"prompt": [20, 21], "max_tokens": 4, "stream": stream}) as resp:
            assert resp.status == 200, "a request the scheduler takes is served as before"


async def test_openai_client_sees_a_rate_limit_error(frontend: Frontend) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://{frontend.http_address}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.RateLimitError, match="max_waiting_requests"):
            await client.completions.create(model=MODEL_NAME, prompt=[13], max_tokens=2)
    finally:
        await client.close()


async def test_grpc_answers_resource_exhausted_with_a_retry_after_trailer(
        stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    call = stub.Generate(pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=[13, 20])))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == FULL
    assert ("retry-after", "1") in tuple(info.value.trailing_metadata() or ())
    responses = [r async for r in stub.Generate(pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=[20])))]
    assert responses[-1].HasField("complete")


@pytest.mark.parametrize("fake", [FakeScheduler(task=common_pb2.REQUEST_KIND_EMBED, error_for=_refuse_marked)],
                         ids=["embed-model"])
async def test_a_pooling_request_with_one_refused_input_is_a_429(frontend: Frontend) -> None:
    url = f"http://{frontend.http_address}/v1/embeddings"
    async with aiohttp.ClientSession() as session, session.post(url, json={"input": [[20], [13], [21]]}) as resp:
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
