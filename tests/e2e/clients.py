"""Thin gRPC and HTTP clients for end-to-end tests."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    finish_reason: str
    num_chunks: int


FINISH_NAMES = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_ABORT: "abort",
}


async def grpc_generate(stub: generation_pb2_grpc.GenerationServiceStub, model: str, prompt: list[int] | str,
                        max_tokens: int, **sampling: object) -> Generated:
    """Run one streaming Generate and collect tokens, text and the finish reason."""
    request = generation_pb2.GenerateRequest(
        model=model, sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling)
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    ids: list[int] = []
    text = ""
    finish = ""
    chunks = 0
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            chunks += 1
            ids.extend(response.chunk.token_ids)
            text += response.chunk.text
        else:
            finish = FINISH_NAMES[response.complete.finish_reason]
    return Generated(ids, text, finish, chunks)


def grpc_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)
