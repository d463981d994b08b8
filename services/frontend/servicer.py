"""gRPC adapter for spindle.v1.GenerationService: decode, one EngineClient call, encode.

Typed errors propagate to shared.grpc_server's interceptor, which maps them to status codes.
A client that cancels a Generate stream cancels this handler, which aborts the request; a
client's deadline becomes the request's (when shorter than the frontend's request timeout).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from services.frontend import wire
from services.frontend.engine_client import EngineClient
from services.frontend.messages import GenerateChunk
from services.frontend.pooling import PoolingClient, rank
from shared.grpc_auth import current_api_key_id
from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, engine: EngineClient, pooling: PoolingClient) -> None:
        self._engine = engine
        self._pooling = pooling

    async def Generate(self, request: generation_pb2.GenerateRequest,  # noqa: N802 - gRPC method name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generation_pb2.GenerateResponse]:
        generate = wire.generate_input_from_proto(request)
        generate.timeout_s = context.time_remaining()  # the client's deadline, if it set one
        generate.traceparent = _traceparent(context)
        generate.api_key_id = current_api_key_id()
        prepared = await self._engine.prepare(generate)
        async with contextlib.aclosing(self._engine.run(prepared)) as events:
            async for event in events:
                if isinstance(event, GenerateChunk):
                    yield wire.chunk_to_proto(event)
                else:
                    yield wire.complete_to_proto(event, self._engine.system_fingerprint)

    async def Tokenize(self, request: generation_pb2.TokenizeRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> generation_pb2.TokenizeResponse:
        result = await self._engine.tokenize(request.model, request.text, request.add_special_tokens)
        return wire.tokenize_to_proto(result, await self._engine.max_model_len())

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> generation_pb2.DetokenizeResponse:
        text = await self._engine.detokenize(request.model, list(request.token_ids))
        return generation_pb2.DetokenizeResponse(text=text)

    async def ListModels(self, request: generation_pb2.ListModelsRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> generation_pb2.ListModelsResponse:
        return wire.models_to_proto(await self._engine.list_models())

    async def Embed(self, request: generation_pb2.EmbedRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> generation_pb2.EmbedResponse:
        embed = wire.embed_input_from_proto(request)
        embed.timeout_s = context.time_remaining()  # the client's deadline, if it set one
        embed.traceparent = _traceparent(context)
        embed.api_key_id = current_api_key_id()
        return wire.embed_to_proto(await self._pooling.embed(embed))

    async def Score(self, request: generation_pb2.ScoreRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> generation_pb2.ScoreResponse:
        score = wire.score_input_from_proto(request)
        score.timeout_s = context.time_remaining()  # the client's deadline, if it set one
        score.traceparent = _traceparent(context)
        score.api_key_id = current_api_key_id()
        result = await self._pooling.score(score)
        return wire.score_to_proto(rank([v[0] for v in result.vectors], request.sort, request.top_n), result.usage)


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    """The caller's W3C trace context, passed on to the scheduler."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return str(value)
    return ""


def register(engine: EngineClient, pooling: PoolingClient) -> Callable[[grpc.aio.Server], None]:
    """A `start_grpc` register callback that adds the servicer to the server."""

    def add(server: grpc.aio.Server) -> None:
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(engine, pooling), server)

    return add
