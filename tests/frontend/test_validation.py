"""Every bad input gets the right status and a message naming the field; the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from openai import AsyncOpenAI

from services.frontend.generation_defaults import GenerationDefaults
from services.frontend.limits import RequestLimits
from services.frontend.messages import SamplingRequest, SchedulerInfo
from services.frontend.server import Frontend
from services.frontend.validation import check_sampling, resolve_sampling
from shared.errors import InvalidArgumentError
from shared.pb.spindle.v1 import generation_pb2 as pb
from shared.pb.spindle.v1 import generation_pb2_grpc
from shared.types import RequestKind
from tests.frontend.conftest import MODEL_NAME

INFO = SchedulerInfo(ready=True, model_id="m", task=RequestKind.GENERATE, max_model_len=128, vocab_size=512)

# ---- unit: defaults and clamping -------------------------------------------------------------


def test_unset_fields_take_neutral_defaults_and_max_tokens_is_clamped() -> None:
    options = resolve_sampling(SamplingRequest(), 100, INFO, GenerationDefaults(), default_max_tokens=256)
    assert (options.temperature, options.top_p, options.top_k, options.min_p) == (1.0, 1.0, 0, 0.0)
    assert (options.repetition_penalty, options.presence_penalty, options.frequency_penalty) == (1.0, 0.0, 0.0)
    assert options.max_tokens == 28  # 128 - 100 < 256
    assert options.logprobs is None and options.seed is None


def test_model_generation_config_sets_defaults_that_requests_override(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    defaults = GenerationDefaults.from_model_dir(tmp_path)
    options = resolve_sampling(SamplingRequest(top_p=0.5, top_k=-1), 10, INFO, defaults, default_max_tokens=16)
    assert (options.temperature, options.top_p, options.top_k, options.max_tokens) == (0.6, 0.5, 0, 16)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 100.5), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2), ("min_p", -0.01), ("min_p", 1.5), ("presence_penalty", 2.1), ("frequency_penalty", -2.1),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1),
    ("seed", -1),
])
def test_out_of_range_sampling_value_names_field_and_value(field: str, value: float) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"^{field}={value}"):
        check_sampling(SamplingRequest(**{field: value}), vocab_size=512, limits=RequestLimits())


# ---- gRPC -----------------------------------------------------------------------------------

Sampling = pb.SamplingParams


def _req(**kwargs: object) -> pb.GenerateRequest:
    kwargs.setdefault("model", MODEL_NAME)
    if "text" not in kwargs and "token_ids" not in kwargs and not kwargs.pop("no_prompt", False):
        kwargs["text"] = "hello"
    return pb.GenerateRequest(**kwargs)  # type: ignore[arg-type]


GRPC_CASES = [
    ("empty text", _req(text=""), "INVALID_ARGUMENT", "prompt is empty"),
    ("no prompt", _req(no_prompt=True), "INVALID_ARGUMENT", "prompt is empty"),
    ("empty token ids", _req(token_ids=pb.TokenIds()), "INVALID_ARGUMENT", "prompt is empty"),
    ("prompt too long", _req(token_ids=pb.TokenIds(ids=[5] * 128)), "INVALID_ARGUMENT", "prompt is too long: 128"),
    ("negative token id", _req(token_ids=pb.TokenIds(ids=[5, -1])), "INVALID_ARGUMENT", "prompt[1]=-1"),
    ("token id past vocab", _req(token_ids=pb.TokenIds(ids=[512])), "INVALID_ARGUMENT", "prompt[0]=512"),
    ("max_tokens 0", _req(sampling=Sampling(max_tokens=0)), "INVALID_ARGUMENT", "max_tokens=0"),
    ("prompt + max_tokens too long", _req(token_ids=pb.TokenIds(ids=[5] * 100), sampling=Sampling(max_tokens=29)),
     "INVALID_ARGUMENT", "max_tokens=29 is too large"),
    ("temperature", _req(sampling=Sampling(temperature=-1)), "INVALID_ARGUMENT", "temperature=-1"),
    ("top_p", _req(sampling=Sampling(top_p=0)), "INVALID_ARGUMENT", "top_p=0"),
    ("top_k", _req(sampling=Sampling(top_k=-5)), "INVALID_ARGUMENT", "top_k=-5"),
    ("min_p", _req(sampling=Sampling(min_p=2)), "INVALID_ARGUMENT", "min_p=2"),
    ("repetition_penalty", _req(sampling=Sampling(repetition_penalty=0)), "INVALID_ARGUMENT", "repetition_penalty=0"),
    ("presence_penalty", _req(sampling=Sampling(presence_penalty=3)), "INVALID_ARGUMENT", "presence_penalty=3"),
    ("frequency_penalty", _req(sampling=Sampling(frequency_penalty=-3)), "INVALID_ARGUMENT", "frequency_penalty=-3"),
    ("logprobs", _req(sampling=Sampling(logprobs=21)), "INVALID_ARGUMENT", "logprobs=21"),
    ("min_tokens > max_tokens", _req(sampling=Sampling(min_tokens=5, max_tokens=2)), "INVALID_ARGUMENT",
     "min_tokens=5 must not exceed max_tokens=2"),
    ("empty stop string", _req(sampling=Sampling(stop=["ok", ""])), "INVALID_ARGUMENT", "stop[1]"),
    ("bad stop token id", _req(sampling=Sampling(stop_token_ids=[600])), "INVALID_ARGUMENT", "stop_token_ids[0]=600"),
    ("unknown model", _req(model="nope"), "NOT_FOUND", "model 'nope' does not exist"),
    ("n too large", _req(n=129), "INVALID_ARGUMENT", "n=129 is out of range"),
    ("n negative", _req(n=-1), "INVALID_ARGUMENT", "n=-1"),
    ("logit_bias range", _req(sampling=Sampling(logit_bias={5: 100.5})), "INVALID_ARGUMENT", "logit_bias[5]=100.5"),
    ("logit_bias token", _req(sampling=Sampling(logit_bias={512: 1})), "INVALID_ARGUMENT",
     "logit_bias: 512 is not a valid token id"),
]


@pytest.mark.parametrize("request_, code, message", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
async def test_grpc_rejects_bad_request_then_serves_a_good_one(
        stub: generation_pb2_grpc.GenerationServiceStub, request_: pb.GenerateRequest, code: str, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Generate(request_):
            pass
    assert info.value.code() == getattr(grpc.StatusCode, code)
    assert message in (info.value.details() or "")
    responses = [r async for r in stub.Generate(_req(sampling=Sampling(max_tokens=2)))]
    assert responses[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH


async def test_grpc_tokenize_unknown_model_is_not_found(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Tokenize(pb.TokenizeRequest(model="nope", text="x"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


# ---- HTTP -----------------------------------------------------------------------------------

COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

HTTP_CASES: list[tuple[str, str, object, int, str]] = [
    ("malformed json", "completions", "{not json", 400, "not valid JSON"),
    ("body not an object", "completions", [1, 2], 400, "must be a JSON object"),
    ("missing prompt", "completions", {"model": MODEL_NAME}, 400, "prompt is required"),
    ("prompt wrong type", "completions", {**COMPLETION, "prompt": {"a": 1}}, 400, "prompt must be"),
    ("several prompts", "completions", {**COMPLETION, "prompt": ["a", "b"]}, 400, "only one prompt"),
    ("empty prompt", "completions", {**COMPLETION, "prompt": ""}, 400, "prompt is empty"),
    ("prompt too long", "completions", {**COMPLETION, "prompt": [5] * 200}, 400, "prompt is too long"),
    ("bad token id", "completions", {**COMPLETION, "prompt": [5, 9999]}, 400, "prompt[1]=9999"),
    ("max_tokens string", "completions", {**COMPLETION, "max_tokens": "10"}, 400, "max_tokens must be an integer"),
    ("max_tokens float", "completions", {**COMPLETION, "max_tokens": 1.5}, 400, "max_tokens must be an integer"),
    ("max_tokens 0", "completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens=0"),
    ("max_tokens huge", "completions", {**COMPLETION, "max_tokens": 10**12}, 400, "max_tokens=1000000000000"),
    ("temperature string", "completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature must be a number"),
    ("temperature bool", "completions", {**COMPLETION, "temperature": True}, 400, "temperature must be a number"),
    ("temperature range", "completions", {**COMPLETION, "temperature": 101}, 400, "temperature=101"),
    ("top_p range", "completions", {**COMPLETION, "top_p": 0}, 400, "top_p=0"),
    ("stream not bool", "completions", {**COMPLETION, "stream": "yes"}, 400, "stream must be a boolean"),
    ("stop wrong type", "completions", {**COMPLETION, "stop": 5}, 400, "stop must be a string or a list"),
    ("n 0", "completions", {**COMPLETION, "n": 0}, 400, "n=0 is out of range"),
    ("n too large", "completions", {**COMPLETION, "n": 129}, 400, "n=129 is out of range"),
    ("n string", "completions", {**COMPLETION, "n": "2"}, 400, "n must be an integer"),
    ("best_of below n", "completions", {**COMPLETION, "n": 3, "best_of": 2}, 400, "best_of=2 must be at least n=3"),
    ("best_of streamed", "completions", {**COMPLETION, "best_of": 3, "stream": True}, 400, "cannot be streamed"),
    ("echo with logprobs", "completions", {**COMPLETION, "echo": True, "logprobs": 1}, 400, "echo with logprobs"),
    ("echo not bool", "completions", {**COMPLETION, "echo": 1}, 400, "echo must be a boolean"),
    ("suffix", "completions", {**COMPLETION, "suffix": "end"}, 400, "suffix is not supported"),
    ("logit_bias not object", "completions", {**COMPLETION, "logit_bias": [1]}, 400,
     "logit_bias must be a JSON object"),
    ("logit_bias key", "completions", {**COMPLETION, "logit_bias": {"abc": 1}}, 400, "logit_bias keys must be"),
    ("logit_bias value", "completions", {**COMPLETION, "logit_bias": {"5": "x"}}, 400, "logit_bias.5 must be a number"),
    ("logit_bias range", "completions", {**COMPLETION, "logit_bias": {"5": -101}}, 400, "logit_bias[5]=-101"),
    ("logit_bias token", "completions", {**COMPLETION, "logit_bias": {"9999": 1}}, 400,
     "9999 is not a valid token id"),
    ("stream_options without stream", "completions", {**COMPLETION, "stream_options": {"include_usage": True}},
     400, "stream_options is only allowed when stream is true"),
    ("stream_options type", "completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": 1}},
     400, "stream_options.include_usage must be a boolean"),
    ("logprobs range", "completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs=21"),
    ("stop_token_ids type", "completions", {**COMPLETION, "stop_token_ids": ["a"]}, 400, "stop_token_ids must be"),
    ("unknown model", "completions", {**COMPLETION, "model": "nope"}, 404, "model 'nope' does not exist"),
    ("bad value while streaming", "completions", {**COMPLETION, "stream": True, "top_k": -3}, 400, "top_k=-3"),
    ("messages missing", "chat/completions", {"model": MODEL_NAME}, 400, "messages must be a list"),
    ("messages empty", "chat/completions", {**CHAT, "messages": []}, 400, "messages is empty"),
    ("role missing", "chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("image for a text-only model", "chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "takes no images"),
    ("top_logprobs without logprobs", "chat/completions", {**CHAT, "top_logprobs": 2}, 400, "requires logprobs"),
    ("top_logprobs range", "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, 400, "logprobs=30"),
    ("tools", "chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat n 0", "chat/completions", {**CHAT, "n": 0}, 400, "n=0 is out of range"),
    ("chat max tokens disagree", "chat/completions", {**CHAT, "max_completion_tokens": 3}, 400,
     "max_completion_tokens=3 and max_tokens=2 disagree"),
    ("chat logit_bias", "chat/completions", {**CHAT, "logit_bias": {"5": 200}}, 400, "logit_bias[5]=200"),
    ("chat unknown model", "chat/completions", {**CHAT, "model": "nope"}, 404, "model 'nope'"),
]


@pytest.mark.parametrize("path, body, status, message", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
async def test_http_rejects_bad_request_then_serves_a_good_one(frontend: Frontend, path: str, body: object,
                                                               status: int, message: str) -> None:
    url = f"http://{frontend.http_address}/v1/"
    data = body if isinstance(body, str) else json.dumps(body)
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status
            assert resp.headers["Content-Type"].startswith("application/json")
            error = (await resp.json())["error"]
        assert message in error["message"]
        assert error["code"] == status
        assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
        good = COMPLETION if path == "completions" else CHAT
        async with session.post(url + path, json=good) as resp:
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["finish_reason"] == "length"


async def test_openai_client_raises_typed_errors(frontend: Frontend) -> None:
    client = AsyncOpenAI(base_url=f"http://{frontend.http_address}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError, match="temperature=-2"):
            await client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-2)
        with pytest.raises(openai.NotFoundError, match="nope"):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    finally:
        await client.close()
