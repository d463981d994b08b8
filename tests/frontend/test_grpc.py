"""The public gRPC API against the fake scheduler: Generate, Tokenize, ListModels, health, reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.frontend.server import Frontend
from services.frontend.servicer import SERVICE_NAME
from shared.pb.spindle.v1 import common_pb2, generation_pb2_grpc
from shared.pb.spindle.v1 import generation_pb2 as pb
from tests.frontend.conftest import MODEL_NAME
from tests.frontend.fake_scheduler import FakeScheduler

Stub = generation_pb2_grpc.GenerationServiceStub


async def _collect(stub: Stub, request: pb.GenerateRequest) -> tuple[list[pb.GenerateChunk], pb.GenerateResponse]:
    chunks, last = [], None
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            chunks.append(response.chunk)
        last = response
    assert last is not None and last.HasField("complete")
    return chunks, last


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_generate_streams_one_chunk_per_step_then_complete(stub: Stub, frontend: Frontend,
                                                                 fake: FakeScheduler) -> None:
    tokenizer = frontend.tokenizer
    prompt = "数据 模型 🙂 hello"
    request = pb.GenerateRequest(model=MODEL_NAME, text=prompt, sampling=pb.SamplingParams(max_tokens=9),
                                 request_id="client-42")
    chunks, last = [], None
    async for response in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),)):
        chunks += [response.chunk] if response.HasField("chunk") else []
        last = response
    prompt_ids = tokenizer.hf.encode(prompt)
    echoed = prompt_ids[1:10]  # the fake echoes the prompt without BOS
    assert [i for c in chunks for i in c.token_ids] == echoed
    assert all(len(c.token_ids) == 1 for c in chunks)  # one step, one token, one message
    assert "".join(c.text for c in chunks) == tokenizer.decode(echoed)
    assert last is not None and last.request_id == "client-42"
    assert (fake.added[0].request_id, fake.added[0].traceparent) == ("client-42", TRACEPARENT)
    assert last.complete.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.complete.usage.prompt_tokens == len(prompt_ids)
    assert last.complete.usage.completion_tokens == 9


async def test_generate_from_token_ids_with_multi_token_steps(stub: Stub, fake: FakeScheduler) -> None:
    fake.tokens_per_step = 3
    fake.num_cached_tokens = 4
    request = pb.GenerateRequest(model="", token_ids=pb.TokenIds(ids=[0, 10, 11, 12, 13, 14]),
                                 sampling=pb.SamplingParams(max_tokens=7, temperature=0.5, seed=7))
    chunks, last = await _collect(stub, request)
    assert [list(c.token_ids) for c in chunks] == [[10, 11, 12], [13, 14, 10], [11]]
    assert last.complete.usage.cached_prompt_tokens == 4
    sampling = fake.added[0].sampling
    assert (sampling.temperature, sampling.seed, sampling.max_tokens) == (0.5, 7, 7)


async def test_generate_ends_with_stop_on_eos_and_hides_it(stub: Stub, frontend: Frontend,
                                                           fake: FakeScheduler) -> None:
    ids = frontend.tokenizer.hf.encode("hello world", add_special_tokens=False)
    fake.script = lambda prompt: [*ids, 1, 9]
    request = pb.GenerateRequest(model=MODEL_NAME, text="x", sampling=pb.SamplingParams(max_tokens=50))
    chunks, last = await _collect(stub, request)
    assert [i for c in chunks for i in c.token_ids] == [*ids, 1]
    assert "".join(c.text for c in chunks) == "hello world"
    assert last.complete.finish_reason == pb.FINISH_REASON_STOP
    assert last.complete.matched_stop == ""  # EOS, not a requested stop


async def test_generate_returns_logprobs_per_token(stub: Stub) -> None:
    request = pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=[20, 21]),
                                 sampling=pb.SamplingParams(max_tokens=3, logprobs=2))
    chunks, _ = await _collect(stub, request)
    positions = [p for c in chunks for p in c.logprobs]
    assert [p.chosen.token_id for p in positions] == [20, 21, 20]
    assert [round(p.chosen.logprob, 4) for p in positions] == [-0.1, -0.2, -0.3]
    assert [[t.token_id for t in p.top] for p in positions] == [[20, 21], [21, 22], [20, 21]]


async def test_default_max_tokens_is_capped_to_the_context(stub: Stub, fake: FakeScheduler) -> None:
    request = pb.GenerateRequest(model=MODEL_NAME, token_ids=pb.TokenIds(ids=[5] * 120))
    _, last = await _collect(stub, request)
    assert fake.added[0].sampling.max_tokens == 8  # max_model_len 128 - 120 < default 16
    assert last.complete.usage.completion_tokens == 8


async def test_scheduler_error_becomes_grpc_status(stub: Stub, fake: FakeScheduler) -> None:
    fake.error_for = lambda add: common_pb2.RequestError(kind=common_pb2.ERROR_KIND_RESOURCE_EXHAUSTED,
                                                         message="no KV blocks")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _collect(stub, pb.GenerateRequest(model=MODEL_NAME, text="hi"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no KV blocks" in (info.value.details() or "")


async def test_client_cancel_aborts_the_request_in_the_scheduler(stub: Stub, fake: FakeScheduler) -> None:
    call = stub.Generate(pb.GenerateRequest(model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_tokens=100)))
    async for response in call:
        assert response.HasField("chunk")
        break
    call.cancel()
    assert await fake.wait_for_abort() == [fake.added[0].request_id]
    assert not fake.running


async def test_concurrent_requests_are_batched_into_one_add_message(stub: Stub, fake: FakeScheduler,
                                                                    frontend: Frontend) -> None:
    engine = frontend.engine
    from services.frontend.messages import GenerateInput, SamplingRequest

    prepared = [await engine.prepare(GenerateInput(prompt_token_ids=[5, 6 + i], sampling=SamplingRequest(max_tokens=2)))
                for i in range(5)]

    async def drain(p: object) -> list[object]:
        return [e async for e in engine.run(p)]  # type: ignore[arg-type]

    results = await asyncio.gather(*(drain(p) for p in prepared))
    assert fake.add_batches == [5]
    assert all(r[-1].usage.completion_tokens == 2 for r in results)  # type: ignore[union-attr]


async def test_scheduler_stream_break_resumes_in_flight_requests_without_losing_a_token(
        stub: Stub, fake: FakeScheduler, frontend: Frontend) -> None:
    fake.step_interval_s = 0.02
    request = pb.GenerateRequest(model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_tokens=12))
    call = stub.Generate(request)
    received: list[int] = []
    while len(received) < 3:
        received.extend((await call.read()).chunk.token_ids)
    fake.break_stream()  # as a crashed scheduler would
    while (response := await call.read()) is not grpc.aio.EOF:
        if response.HasField("chunk"):
            received.extend(response.chunk.token_ids)
        last = response
    assert last.complete.finish_reason == pb.FINISH_REASON_LENGTH
    first, again = fake.added[0], fake.added[-1]
    assert fake.num_connects == 2 and again.resumed and not first.resumed
    assert 3 <= len(again.output_token_ids) < 12
    # Nothing duplicated, nothing missing: exactly what an unbroken stream gives.
    script = fake.script(list(first.prompt_token_ids))
    assert received == [script[i % len(script)] for i in range(12)]
    assert received[:len(again.output_token_ids)] == list(again.output_token_ids)


async def test_requests_fail_with_unavailable_when_no_scheduler_returns_in_time(
        tokenizer_dir: object, fake: FakeScheduler, scheduler_addr: str) -> None:
    from tests.frontend.conftest import make_config

    server = Frontend(make_config(tokenizer_dir, scheduler_addr))  # type: ignore[arg-type]
    server.scheduler._resume_timeout_s = 0.3
    server.scheduler._backoff_initial_s = server.scheduler._backoff_max_s = 5.0  # it will not reconnect in time
    await server.start()
    try:
        await server.scheduler.wait_ready(10)
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            call = Stub(channel).Generate(pb.GenerateRequest(model=MODEL_NAME, text="hello",
                                                             sampling=pb.SamplingParams(max_tokens=100)))
            await call.read()
            fake.break_stream()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not come back" in (info.value.details() or "")
    finally:
        await server.stop(0)


async def test_request_timeout_aborts_with_finish_reason_abort(tokenizer_dir: object, fake: FakeScheduler,
                                                               scheduler_addr: str) -> None:
    from tests.frontend.conftest import make_config

    fake.step_interval_s = 0.05
    server = Frontend(make_config(tokenizer_dir, scheduler_addr, request_timeout_s=0.12))  # type: ignore[arg-type]
    await server.start()
    try:
        await server.scheduler.wait_ready(10)
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            chunks, last = await _collect(Stub(channel), pb.GenerateRequest(
                model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_tokens=100)))
        assert last.complete.finish_reason == pb.FINISH_REASON_ABORT
        assert 0 < len(chunks) < 5
        assert await fake.wait_for_abort() == [fake.added[0].request_id]
    finally:
        await server.stop(0)


async def test_tokenize(stub: Stub, frontend: Frontend) -> None:
    response = await stub.Tokenize(pb.TokenizeRequest(model=MODEL_NAME, text="hello 🙂", add_special_tokens=True))
    assert list(response.token_ids) == frontend.tokenizer.hf.encode("hello 🙂")
    assert response.tokens[0] == "<s>"
    assert "".join(response.tokens[1:3]) == "hello "[: len("".join(response.tokens[1:3]))]
    bare = await stub.Tokenize(pb.TokenizeRequest(model=MODEL_NAME, text="hello"))
    assert list(bare.token_ids) == list(response.token_ids[1:len(bare.token_ids) + 1])


async def test_list_models(stub: Stub) -> None:
    response = await stub.ListModels(pb.ListModelsRequest())
    assert [(m.id, m.task, m.max_model_len) for m in response.models] == [(MODEL_NAME, pb.MODEL_TASK_GENERATE, 128)]


async def test_embed_on_a_generate_model_is_invalid_argument(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Embed(pb.EmbedRequest(model=MODEL_NAME, inputs=["x"]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not support embeddings" in (info.value.details() or "")


async def test_health_is_serving_and_reflection_lists_the_service(frontend: Frontend) -> None:
    async with grpc.aio.insecure_channel(frontend.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(100):
            status = (await health.Check(health_pb2.HealthCheckRequest(service="spindle.v1.GenerationService"))).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.01)
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in responses for s in r.list_services_response.service]
        assert "spindle.v1.GenerationService" in names
        assert "grpc.health.v1.Health" in names


async def test_health_is_not_serving_until_the_scheduler_is_ready(tokenizer_dir: object, fake: FakeScheduler,
                                                                  scheduler_addr: str) -> None:
    from tests.frontend.conftest import make_config

    fake.ready = False
    server = Frontend(make_config(tokenizer_dir, scheduler_addr))  # type: ignore[arg-type]
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)  # readiness
            await asyncio.sleep(0.2)
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            liveness = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert liveness.status == health_pb2.HealthCheckResponse.SERVING  # alive, so never restarted for it
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(Stub(channel), pb.GenerateRequest(model=MODEL_NAME, text="hi"))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            fake.ready = True
            await server.scheduler.wait_ready(10)
            for _ in range(100):
                if (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.01)
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


async def test_a_request_arriving_while_the_scheduler_is_away_waits_for_it(
        tokenizer_dir: object, fake: FakeScheduler, scheduler_addr: str) -> None:
    from tests.frontend.conftest import make_config

    server = Frontend(make_config(tokenizer_dir, scheduler_addr))  # type: ignore[arg-type]
    server.scheduler._backoff_initial_s = server.scheduler._backoff_max_s = 0.5  # back after half a second
    await server.start()
    try:
        await server.scheduler.wait_ready(10)
        while fake.num_connects < 1:  # the fake's side of the stream is up
            await asyncio.sleep(0.01)
        num_added = len(fake.added)
        fake.break_stream()  # a scheduler restarting
        while server.scheduler.is_ready:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            request = pb.GenerateRequest(model=MODEL_NAME, text="hello", sampling=pb.SamplingParams(max_tokens=4))
            chunks, last = await _collect(Stub(channel), request)
        assert last.complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in chunks) == 4
        assert fake.num_connects == 2
        new = fake.added[num_added:]
        assert len(new) == 1 and not new[0].resumed  # sent once, as a new request
    finally:
        await server.stop(0)


@pytest.mark.parametrize("draining", [False, True])
async def test_losing_the_scheduler_warns_unless_the_frontend_drains(
        tokenizer_dir: object, fake: FakeScheduler, scheduler_addr: str, draining: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    """`spindle serve` SIGTERMs scheduler and frontend together: the scheduler going away while
    the frontend drains is expected, not a warning; at any other time it is one."""
    from tests.frontend.conftest import make_config

    server = Frontend(make_config(tokenizer_dir, scheduler_addr))  # type: ignore[arg-type]
    server.scheduler._backoff_initial_s = server.scheduler._backoff_max_s = 5.0  # stays away meanwhile
    await server.start()
    try:
        await server.scheduler.wait_ready(10)
        while fake.num_connects < 1:
            await asyncio.sleep(0.01)
        if draining:
            await server.drain()  # nothing in flight: returns at once
        caplog.set_level("INFO", logger="services.frontend")
        fake.break_stream()

        def lost() -> list[str]:
            return [r.levelname for r in caplog.records if r.name == "services.frontend.server"
                    and "not ready" in r.getMessage() and "scheduler" in r.getMessage()]

        for _ in range(500):
            if lost():
                break
            await asyncio.sleep(0.01)
        assert lost() == (["INFO"] if draining else ["WARNING"])
        warned = [r for r in caplog.records if r.name.startswith("services.frontend") and r.levelname == "WARNING"]
        assert bool(warned) is not draining  # the stream's end too: info while draining
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            status = (await health_pb2_grpc.HealthStub(channel).Check(check)).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # not ready either way
    finally:
        await server.stop(0)
