"""n > 1 and best_of in the frontend: how samples are sent, merged, aborted and picked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from openai import AsyncOpenAI

from services.frontend.best_of import pick_best
from services.frontend.messages import FinishReason, GenerateChunk, GenerateComplete, GenerateEvent, Usage
from services.frontend.samples import merge, with_total_usage
from services.frontend.server import Frontend
from shared.pb.spindle.v1 import common_pb2
from tests.frontend.conftest import MODEL_NAME
from tests.frontend.fake_scheduler import FakeScheduler


@pytest.fixture
def http_url(frontend: Frontend) -> str:
    return f"http://{frontend.http_address}"


async def test_n_samples_leave_as_one_batch_sharing_the_first_ones_prompt(http_url: str, fake: FakeScheduler) -> None:
    async with AsyncOpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0) as client:
        result = await client.completions.create(model=MODEL_NAME, prompt="hello there", n=3, max_tokens=4,
                                                 seed=2**64 - 2, temperature=1.0, extra_headers={"X-Request-Id": "abc"})
    assert fake.add_batches == [3]
    assert [a.request_id for a in fake.added] == ["abc-0", "abc-1", "abc-2"]
    assert [a.shares_prompt_with for a in fake.added] == ["", "abc-0", "abc-0"]
    assert [a.sampling.seed for a in fake.added] == [2**64 - 2, 2**64 - 1, 0]  # seed + i, wrapped as a uint64
    assert result.id == "cmpl-abc" and [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage.completion_tokens == 12 and result.usage.prompt_tokens == len(fake.added[0].prompt_token_ids)


async def test_client_disconnect_aborts_every_sample(http_url: str, fake: FakeScheduler) -> None:
    fake.step_interval_s = 0.01
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 100, "stream": True, "n": 3}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(http_url + "/v1/completions", json=body)
        await resp.content.readline()
        resp.close()
    for _ in range(200):
        if len(fake.aborted) == 3:
            break
        await asyncio.sleep(0.01)
    assert sorted(fake.aborted) == sorted(a.request_id for a in fake.added)
    assert not fake.running


async def test_one_failed_sample_fails_the_request_and_aborts_the_others(http_url: str, fake: FakeScheduler) -> None:
    fake.step_interval_s = 0.01
    fake.error_for = lambda add: (common_pb2.RequestError(kind=common_pb2.ERROR_KIND_RESOURCE_EXHAUSTED,
                                                           message="queue full") if add.request_id.endswith("-1")
                                  else None)
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 100, "n": 3}
    async with aiohttp.ClientSession() as session, session.post(http_url + "/v1/completions", json=body) as resp:
        assert resp.status == 429
        assert "queue full" in (await resp.json())["error"]["message"]
    for _ in range(200):
        if len(fake.aborted) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(fake.aborted) == [fake.added[0].request_id, fake.added[2].request_id]


async def _items(*items: object, fail: Exception | None = None, delay: float = 0.0) -> AsyncIterator[object]:
    for item in items:
        await asyncio.sleep(delay)
        yield item
    if fail is not None:
        raise fail


async def test_merge_interleaves_and_the_first_error_closes_the_rest() -> None:
    assert sorted([x async for x in merge([_items(1, 2), _items(3)])]) == [1, 2, 3]
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[object]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield "tick"
        finally:
            closed.set()

    with pytest.raises(ValueError, match="boom"):
        async for _ in merge([endless(), _items(fail=ValueError("boom"), delay=0.03)]):
            pass
    assert closed.is_set()


def _candidate(index: int, tokens: int, cumulative: float) -> list[GenerateEvent]:
    return [GenerateChunk("r", [5] * tokens, f"text{index}", index=index),
            GenerateComplete("r", FinishReason.LENGTH, Usage(3, tokens), index=index, cumulative_logprob=cumulative)]


async def test_pick_best_ranks_by_logprob_per_token_and_counts_every_candidate() -> None:
    events = [*_candidate(0, 4, -8.0), *_candidate(1, 2, -2.0), *_candidate(2, 4, -4.0)]
    events[-1].total_usage = Usage(3, 10)  # type: ignore[union-attr]
    picked = [e async for e in pick_best(_items(*events), 2, keep_logprobs=False)]
    assert [(type(e).__name__, e.index, getattr(e, "text", "")) for e in picked] == [
        ("GenerateChunk", 0, "text1"), ("GenerateComplete", 0, ""), ("GenerateChunk", 1, "text2"),
        ("GenerateComplete", 1, "")]
    assert picked[1].total_usage is None and picked[3].total_usage == Usage(3, 10)  # type: ignore[union-attr]


async def test_closing_the_events_closes_every_sample_at_once() -> None:
    closed: list[int] = []

    async def sample(index: int) -> AsyncIterator[GenerateEvent]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield GenerateChunk("r", [5], "x", index=index)
        finally:
            closed.append(index)

    for events in (with_total_usage(merge([sample(0), sample(1)]), 2),
                   pick_best(with_total_usage(sample(2), 1), 1, keep_logprobs=False)):
        task = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)
        if task.done():
            await events.aclose()  # the client left between two events
        else:
            task.cancel()  # the client left while waiting for one (best_of buffers)
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert sorted(closed) == [0, 1, 2]
