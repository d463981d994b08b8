"""Per-request limits and wire ranges: each is a 400 / INVALID_ARGUMENT (413 for the body) naming the
field and the limit, checked before the request reaches the scheduler; the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from services.frontend.limits import RequestLimits, effective_timeout_s
from services.frontend.server import Frontend
from shared.pb.spindle.v1 import common_pb2, generation_pb2_grpc
from shared.pb.spindle.v1 import generation_pb2 as pb
from tests.frontend.conftest import MODEL_NAME, make_config
from tests.frontend.fake_scheduler import FakeScheduler

TINY = RequestLimits(max_body_bytes=4096, max_prompt_chars=100, max_prompt_tokens=50, max_output_tokens=20,
                     max_messages=3, max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=2,
                     max_logprobs=3, max_batch_inputs=2)
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
Stub = generation_pb2_grpc.GenerationServiceStub


@pytest.fixture
async def frontend(tokenizer_dir: Path, fake: FakeScheduler, scheduler_addr: str) -> AsyncIterator[Frontend]:
    server = Frontend(make_config(tokenizer_dir, scheduler_addr, limits=TINY))
    await server.start()
    await server.scheduler.wait_ready(10)
    yield server
    await server.stop(0)


async def _post(frontend: Frontend, path: str, body: object, headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, object]]:
    """(status, JSON body) of one POST to /v1/<path>."""
    async with aiohttp.ClientSession() as session, \
            session.post(f"http://{frontend.http_address}/v1/{path}", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def _message(body: dict[str, object]) -> str:
    error = body["error"]
    assert isinstance(error, dict)
    return str(error["message"])


def test_limits_must_fit_their_wire_type() -> None:
    with pytest.raises(ValueError, match="max_output_tokens=2147483648"):
        RequestLimits(max_output_tokens=2**31)
    with pytest.raises(ValueError, match="max_messages=0"):
        RequestLimits(max_messages=0)


def test_the_shorter_of_the_request_timeout_and_the_client_deadline_wins() -> None:
    assert effective_timeout_s(600.0, None) == 600.0
    assert effective_timeout_s(600.0, 2.5) == 2.5
    assert effective_timeout_s(0.0, 2.5) == 2.5  # 0: the frontend sets no timeout of its own
    assert effective_timeout_s(0.0, None) is None
    assert effective_timeout_s(10.0, -1.0) == 0.0  # a deadline already past


HTTP_CASES: list[tuple[str, str, object, str]] = [
    ("prompt chars", "completions", {**COMPLETION, "prompt": "x" * 101}, "max_prompt_chars"),
    ("prompt token ids", "completions", {**COMPLETION, "prompt": [5] * 51}, "max_prompt_tokens"),
    ("max_tokens", "completions", {**COMPLETION, "max_tokens": 21}, "max_output_tokens"),
    ("stop count", "completions", {**COMPLETION, "stop": ["a", "b", "c"]}, "max_stop_strings"),
    ("stop length", "completions", {**COMPLETION, "stop": ["abcdef"]}, "max_stop_string_chars"),
    ("stop token ids", "completions", {**COMPLETION, "stop_token_ids": [5, 6, 7]}, "max_stop_token_ids"),
    ("logprobs", "completions", {**COMPLETION, "logprobs": 4}, "max_logprobs"),
    ("top_logprobs", "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4}, "max_logprobs"),
    ("message count", "chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 4},
     "max_messages"),
    ("message chars", "chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 60}] * 2},
     "max_prompt_chars"),
    # Numbers that fit JSON but not the int32 / uint64 that carries them to the scheduler.
    ("priority past int32", "completions", {**COMPLETION, "priority": 2**31}, "priority=2147483648 is out of range"),
    ("negative priority past int32", "chat/completions", {**CHAT, "priority": -(2**31) - 1}, "priority=-2147483649"),
    ("seed past uint64", "completions", {**COMPLETION, "seed": 2**64}, "seed=18446744073709551616"),
    ("top_k past int32", "completions", {**COMPLETION, "top_k": 2**31}, "top_k=2147483648"),
    ("integer beyond any float", "completions", {**COMPLETION, "temperature": 10**400}, "temperature=1.000e+400"),
    ("infinity", "completions", '{"prompt": "hi", "top_p": Infinity}', "top_p=inf"),
    ("huge token id", "completions", {**COMPLETION, "prompt": [10**40]}, "prompt[0]=1.000e+40"),
    # Bodies no parser or encoder further down could take.
    ("lone surrogate", "completions", '{"prompt": "a\\ud800b"}', "not valid Unicode"),
    ("lone surrogate in a key", "chat/completions", '{"\\udfff": 1, "messages": []}', "not valid Unicode"),
    ("deep nesting", "completions", '{"prompt": ' + "[" * 2000 + "]" * 2000 + "}", "nested too deeply"),
    ("deep nesting in a typed field", "completions", {**COMPLETION, "temperature": [[[[[[1]]]]]]},
     "temperature must be a number, got array of 1 items"),
]


@pytest.mark.parametrize("path, body, message", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
async def test_http_limit_is_a_400_naming_it(frontend: Frontend, fake: FakeScheduler, path: str, body: object,
                                             message: str) -> None:
    url = f"http://{frontend.http_address}/v1/{path}"
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=data) as resp:
            error = (await resp.json())["error"]
            assert (resp.status, error["code"]) == (400, 400), error
        assert message in error["message"]
        assert len(error["message"]) < 300, "a client's value is never echoed at length"
        async with session.post(url, json=COMPLETION if path == "completions" else CHAT) as resp:
            assert resp.status == 200
    assert len(fake.added) == 1, "nothing refused reached the scheduler"


async def test_body_past_max_body_bytes_is_a_413(frontend: Frontend) -> None:
    url = f"http://{frontend.http_address}/v1/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={**COMPLETION, "prompt": "x" * 5000}) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
        assert "4096 bytes (max_body_bytes)" in error["message"] and error["code"] == 413

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds while reading
            for _ in range(10):
                yield b" " * 1000

        async with session.post(url + "", data=chunks()) as resp:
            assert resp.status == 413


async def test_prompt_tokens_are_counted_after_tokenizing(frontend: Frontend) -> None:
    prompt = "数据" * 40  # 80 characters, well within max_prompt_chars
    assert len(frontend.tokenizer.hf.encode(prompt)) > TINY.max_prompt_tokens
    status, body = await _post(frontend, "completions", {**COMPLETION, "prompt": prompt})
    assert status == 400 and "max_prompt_tokens" in _message(body)


@pytest.mark.parametrize("header, message", [
    ("x" * 300, "request_id is too long"),
    ("tab\there", "must be printable ASCII"),
])
async def test_request_id_header_must_be_short_printable_ascii(frontend: Frontend, header: str, message: str) -> None:
    status, body = await _post(frontend, "completions", COMPLETION, {"X-Request-Id": header})
    assert status == 400 and message in _message(body)


async def test_malformed_traceparent_is_dropped_not_forwarded(frontend: Frontend, fake: FakeScheduler) -> None:
    status, _ = await _post(frontend, "completions", COMPLETION, {"traceparent": "00-not-a-trace-context"})
    assert status == 200 and fake.added[0].traceparent == ""


def _generate(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(**sampling))  # type: ignore[arg-type]


GRPC_CASES = [
    ("prompt chars", pb.GenerateRequest(model=MODEL_NAME, text="x" * 101), "max_prompt_chars"),
    ("prompt token ids", pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=[5] * 51)),
     "max_prompt_tokens"),
    ("max_tokens", _generate(max_tokens=21), "max_output_tokens"),
    ("stop count", _generate(stop=["a", "b", "c"]), "max_stop_strings"),
    ("stop length", _generate(stop=["abcdef"]), "max_stop_string_chars"),
    ("stop token ids", _generate(stop_token_ids=[5, 6, 7]), "max_stop_token_ids"),
    ("logprobs", _generate(logprobs=4), "max_logprobs"),
    ("request id", pb.GenerateRequest(model=MODEL_NAME, text="hi", request_id="é"), "printable ASCII"),
]


@pytest.mark.parametrize("request_, message", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
async def test_grpc_limit_is_invalid_argument_naming_it(frontend: Frontend, request_: pb.GenerateRequest,
                                                        message: str) -> None:
    async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
        stub = Stub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(request_):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError, match="max_prompt_chars"):
            await stub.Tokenize(pb.TokenizeRequest(model=MODEL_NAME, text="x" * 101))


async def test_grpc_bytes_that_are_not_a_message_are_invalid_argument(frontend: Frontend) -> None:
    raw = pb.GenerateRequest(model=MODEL_NAME, text="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
    async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
        generate = channel.unary_stream("/spindle.v1.GenerationService/Generate", request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in generate(raw):
                pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be parsed" in (info.value.details() or "")


@pytest.mark.parametrize("fake", [FakeScheduler(task=common_pb2.REQUEST_KIND_EMBED)], ids=["embed-model"])
async def test_pooling_inputs_are_limited_in_number_and_length(frontend: Frontend) -> None:
    async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
        stub = Stub(channel)
        for request, message in ((pb.EmbedRequest(inputs=["a", "b", "c"]), "max_batch_inputs"),
                                 (pb.EmbedRequest(inputs=["a", "x" * 101]), "input[1] length"),
                                 (pb.EmbedRequest(inputs=["a"], priority=-(2**31)), "")):
            if not message:  # int32's own range is fine on gRPC
                assert len((await stub.Embed(request)).embeddings) == 1
                continue
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Embed(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (info.value.details() or "")
    status, body = await _post(frontend, "embeddings", {"input": [[5] * 51]})
    assert status == 400 and "max_prompt_tokens" in _message(body)
    status, body = await _post(frontend, "embeddings", {"input": "hi", "priority": 2**40})
    assert status == 400 and "priority=1099511627776" in _message(body)


async def test_grpc_message_past_max_body_bytes_is_refused_before_parsing(frontend: Frontend) -> None:
    async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await Stub(channel).Tokenize(pb.TokenizeRequest(model=MODEL_NAME, text="x" * 5000))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (info.value.details() or "")
