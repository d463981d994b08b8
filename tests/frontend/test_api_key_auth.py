"""API keys on the public APIs: 401 / UNAUTHENTICATED without a valid key, health and reflection open,
and the accepted key's id (never the key) handed to request handling."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from openai import AsyncOpenAI

from services.frontend.__main__ import add_arguments, config_from_args
from services.frontend.messages import EmbedInput, GenerateInput
from services.frontend.server import Frontend
from shared.api_keys import ApiKeys, key_digest, key_id
from shared.pb.spindle.v1 import generation_pb2 as pb
from shared.pb.spindle.v1 import generation_pb2_grpc
from tests.frontend.conftest import MODEL_NAME, make_config
from tests.frontend.fake_scheduler import FakeScheduler

KEY = "sk-spindle-test-key"
OTHER_KEY = "sk-second-key"


@pytest.fixture
async def frontend(tokenizer_dir: Path, fake: FakeScheduler, scheduler_addr: str) -> AsyncIterator[Frontend]:
    server = Frontend(make_config(tokenizer_dir, scheduler_addr, api_keys=ApiKeys.from_keys([KEY, OTHER_KEY])))
    await server.start()
    await server.scheduler.wait_ready(10)
    yield server
    await server.stop(0)


@pytest.fixture
def seen_key_ids(frontend: Frontend, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The api_key_id of every generate and embed input that reached the engine."""
    seen: list[str] = []
    prepare, embed = frontend.engine.prepare, frontend.pooling.embed

    async def spy_prepare(request: GenerateInput) -> object:
        seen.append(request.api_key_id)
        return await prepare(request)

    async def spy_embed(request: EmbedInput) -> object:
        seen.append(request.api_key_id)
        return await embed(request)

    monkeypatch.setattr(frontend.engine, "prepare", spy_prepare)
    monkeypatch.setattr(frontend.pooling, "embed", spy_embed)
    return seen


def _http(frontend: Frontend) -> str:
    return f"http://{frontend.http_address}"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
async def test_http_without_a_valid_key_is_401_with_an_openai_error(frontend: Frontend,
                                                                     headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
                             ("GET", "/no/such/route")):
            async with session.request(method, _http(frontend) + path, headers=headers, json={}) as resp:
                assert resp.status == 401, path
                assert resp.headers["WWW-Authenticate"] == "Bearer"
                error = (await resp.json())["error"]
                assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
                assert KEY not in error["message"]


async def test_http_with_a_valid_key_serves_and_hands_on_its_id(frontend: Frontend,
                                                                 seen_key_ids: list[str]) -> None:
    client = AsyncOpenAI(base_url=_http(frontend) + "/v1", api_key=OTHER_KEY, max_retries=0)
    try:
        result = await client.completions.create(model=MODEL_NAME, prompt=[40, 41], max_tokens=2)
        assert result.choices[0].finish_reason == "length"
        assert [m.id for m in (await client.models.list()).data] == [MODEL_NAME]
        with pytest.raises(openai.APIStatusError):  # the fake serves a decoder: what matters is who asked
            await client.embeddings.create(model=MODEL_NAME, input="hi")
    finally:
        await client.close()
    assert seen_key_ids == [key_id(key_digest(OTHER_KEY))] * 2
    async with AsyncOpenAI(base_url=_http(frontend) + "/v1", api_key="nope", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError):
            await intruder.models.list()


async def test_http_health_needs_no_key(frontend: Frontend) -> None:
    async with aiohttp.ClientSession() as session, session.get(_http(frontend) + "/health") as resp:
        assert resp.status == 200


@pytest.fixture
async def channel(frontend: Frontend) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
        yield channel


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong-key"),), (("authorization", KEY),)])
async def test_grpc_without_a_valid_key_is_unauthenticated(channel: grpc.aio.Channel,
                                                           metadata: tuple[tuple[str, str], ...]) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
    assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert KEY not in (unary.value.details() or "")
    request = pb.GenerateRequest(model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError) as stream:
        async for _ in stub.Generate(request, metadata=metadata):
            pass
    assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_grpc_with_a_valid_key_serves_and_hands_on_its_id(channel: grpc.aio.Channel,
                                                                  seen_key_ids: list[str]) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    metadata = (("authorization", f"Bearer {KEY}"),)
    request = pb.GenerateRequest(model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_tokens=2))
    responses = [r async for r in stub.Generate(request, metadata=metadata)]
    assert responses[-1].complete.finish_reason == pb.FINISH_REASON_LENGTH
    models = await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
    assert [m.id for m in models.models] == [MODEL_NAME]
    assert seen_key_ids == [key_id(key_digest(KEY))]


async def test_grpc_health_and_reflection_need_no_key(channel: grpc.aio.Channel) -> None:
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = [a async for a in reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]))]
    assert "spindle.v1.GenerationService" in {s.name for s in answers[0].list_services_response.service}


def test_flags_hash_the_key_file_and_spindle_api_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY}\n")
    monkeypatch.setenv("SPINDLE_API_KEYS", f"{OTHER_KEY},third")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--model", "m", "--api-key-file", str(key_file)]))
    assert len(config.api_keys.digests) == 3 and config.api_keys.check(KEY) and config.api_keys.check("third")
    assert KEY not in repr(config)
    monkeypatch.delenv("SPINDLE_API_KEYS")
    assert not config_from_args(parser.parse_args(["--model", "m"])).api_keys.is_enabled
