"""Send one soak `Shape` to the public gRPC API (`GenerationService.Generate`) and judge it.

An abort either cancels the call on a shared channel (RST_STREAM: the connection lives on) or,
with `disconnect`, closes a channel of the request's own (the TCP connection goes away), after
some chunks or some time. Never raises for what the server does.
"""

from __future__ import annotations

import contextlib
import itertools

import grpc

from benchmarks.soak_outcome import ABORTED, AbortTimer, Outcome, judge_failure, judge_finish, judge_refusal
from benchmarks.soak_shapes import Shape
from shared.pb.spindle.v1 import generation_pb2, generation_pb2_grpc

_FINISH = {generation_pb2.FINISH_REASON_STOP: "stop", generation_pb2.FINISH_REASON_LENGTH: "length",
           generation_pb2.FINISH_REASON_ABORT: "abort"}
# SamplingParams fields, by the OpenAI names soak shapes use (the same on the wire).
_SAMPLING_FIELDS = frozenset(generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def grpc_request(shape: Shape, model: str) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of `shape` (text or token-id prompt)."""
    unknown = set(shape.sampling) - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"sampling fields {sorted(unknown)} do not exist in SamplingParams")
    request = generation_pb2.GenerateRequest(model=model, sampling=generation_pb2.SamplingParams(**shape.sampling))
    if isinstance(shape.prompt, str):
        request.text = shape.prompt
    else:
        request.token_ids.ids.extend(shape.prompt)
    return request


class Channels:
    """A few shared channels to `address`, handed out in turn, plus own ones for disconnects."""

    def __init__(self, address: str, count: int = 4) -> None:
        self.address = address
        self._shared = [grpc.aio.insecure_channel(address) for _ in range(count)]
        self._turn = itertools.cycle(self._shared)

    def shared(self) -> grpc.aio.Channel:
        return next(self._turn)

    def own(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address)

    async def close(self) -> None:
        for channel in self._shared:
            await channel.close()


async def send_grpc(channels: Channels, model: str, shape: Shape) -> Outcome:
    """Run one Generate stream to its end, or abort it as `shape.abort` says."""
    abort = shape.abort
    own = channels.own() if abort is not None and abort.disconnect else None
    stub = generation_pb2_grpc.GenerationServiceStub(own or channels.shared())
    timer = AbortTimer(abort.after_s if abort else None)
    call = stub.Generate(grpc_request(shape, model))
    chunks = tokens = 0
    finish: str | None = None
    try:
        async with timer.scope:
            async for response in call:
                if response.HasField("complete"):
                    finish = _FINISH.get(response.complete.finish_reason, str(response.complete.finish_reason))
                    continue
                chunks += 1
                tokens += len(response.chunk.token_ids)
                if abort is not None and abort.after_chunks is not None and chunks >= abort.after_chunks:
                    await _hang_up(call, own)
                    return Outcome(ABORTED, shape.protocol, tokens)
        return judge_finish(shape, finish, tokens)
    except TimeoutError:
        if not timer.fired():
            return judge_failure(shape, tokens, "client timeout: the request hung")
        await _hang_up(call, own)
        return Outcome(ABORTED, shape.protocol, tokens)
    except grpc.aio.AioRpcError as exc:
        if chunks == 0:
            return judge_refusal(shape, exc.code().name, exc.details() or "")
        return judge_failure(shape, tokens, f"stream failed with {exc.code().name}: {exc.details()}")
    finally:
        if own is not None:
            await own.close()


async def _hang_up(call: grpc.aio.UnaryStreamCall, own: grpc.aio.Channel | None) -> None:
    """Cancel the call, or drop the connection under it when the request has a channel of its own."""
    if own is not None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await own.close()
    else:
        call.cancel()
