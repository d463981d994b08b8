"""Backpressure through `spindle serve`: with one running slot and one waiting place, a third request is
refused at once (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED with a retry-after trailer) while the
others complete."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import grpc
import pytest

from shared.pb.spindle.v1 import generation_pb2 as pb
from shared.pb.spindle.v1 import generation_pb2_grpc
from tests.e2e.server import RunningServer, spindle_serve

pytestmark = pytest.mark.e2e

LONG = 1000  # tokens the running request generates: seconds of work, while the others arrive


async def _stream(session: aiohttp.ClientSession, server: RunningServer, max_tokens: int,
                  started: asyncio.Event | None = None) -> tuple[int, str, int]:
    """(status, Retry-After header, tokens generated) of one streamed completion."""
    body = {"model": server.model_name, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(server.http_url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, resp.headers.get("Retry-After", ""), 0
        num_tokens = 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                num_tokens = usage["completion_tokens"] if usage else num_tokens
                if started is not None:
                    started.set()
        return resp.status, "", num_tokens


async def _refuse_and_serve(server: RunningServer) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        started = asyncio.Event()
        running = asyncio.ensure_future(_stream(session, server, LONG, started))
        await asyncio.wait_for(started.wait(), 60)  # it holds the only running slot now
        # Two more at once: one takes the only waiting place, the other is refused at once.
        pair = [asyncio.ensure_future(_stream(session, server, 8)) for _ in range(2)]
        [refused], [queued] = await asyncio.wait(pair, return_when=asyncio.FIRST_COMPLETED)
        assert refused.result() == (429, "1", 0)
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            request = pb.GenerateRequest(model=server.model_name, token_ids=pb.TokenIds(ids=[5, 6]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request):
                    pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting_requests" in (info.value.details() or "")
        assert ("retry-after", "1") in tuple(info.value.trailing_metadata() or ())
        assert await queued == (200, "", 8), "the queued request runs once the slot is free"
        assert await running == (200, "", LONG)


def test_full_queue_refuses_new_requests_with_429_and_serves_the_rest(tiny_models: dict[str, Path]) -> None:
    with spindle_serve(tiny_models["llama"], "--max-num-seqs", "1", "--max-waiting-requests", "1",
                       "--num-scheduler-steps", "1") as server:
        asyncio.run(_refuse_and_serve(server))
