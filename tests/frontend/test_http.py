"""The OpenAI-compatible HTTP API through the official openai client and raw aiohttp."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from openai import AsyncOpenAI

from services.frontend.server import Frontend
from tests.frontend.conftest import MODEL_NAME, make_config
from tests.frontend.fake_scheduler import FakeScheduler, echo_script


@pytest.fixture
def http_url(frontend: Frontend) -> str:
    return f"http://{frontend.http_address}"


@pytest.fixture
async def client(http_url: str) -> AsyncIterator[AsyncOpenAI]:
    openai_client = AsyncOpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0)
    yield openai_client
    await openai_client.close()


def _expected(frontend: Frontend, prompt_ids: list[int], n: int) -> str:
    return frontend.tokenizer.decode(echo_script(prompt_ids)[:n])


def _chat_prompt_ids(frontend: Frontend, messages: list[tuple[str, str]]) -> list[int]:
    conversation = [{"role": role, "content": content} for role, content in messages]
    text = frontend.tokenizer.hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return frontend.tokenizer.hf.encode(text, add_special_tokens=False)


async def test_completion(client: AsyncOpenAI, frontend: Frontend) -> None:
    result = await client.completions.create(model=MODEL_NAME, prompt="hello 数据", max_tokens=5)
    prompt_ids = frontend.tokenizer.hf.encode("hello 数据")
    choice = result.choices[0]
    assert choice.text == _expected(frontend, prompt_ids, 5)
    assert choice.finish_reason == "length"
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 5)


async def test_completion_stream_with_usage(client: AsyncOpenAI, frontend: Frontend) -> None:
    stream = await client.completions.create(model=MODEL_NAME, prompt=[0, 40, 41, 42], max_tokens=6, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == frontend.tokenizer.decode([40, 41, 42, 40, 41, 42])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.total_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


async def test_completion_logprobs(client: AsyncOpenAI, frontend: Frontend) -> None:
    result = await client.completions.create(model=MODEL_NAME, prompt=[40, 41], max_tokens=2, logprobs=1)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    tokens = [frontend.tokenizer.token_text(40), frontend.tokenizer.token_text(41)]
    assert logprobs.tokens == tokens
    assert logprobs.token_logprobs == pytest.approx([-0.1, -0.2])
    assert logprobs.top_logprobs == [{tokens[0]: pytest.approx(-0.1)}, {tokens[1]: pytest.approx(-0.2)}]
    assert logprobs.text_offset == [0, len(tokens[0])]


async def test_completion_with_stop_string(client: AsyncOpenAI) -> None:
    result = await client.completions.create(model=MODEL_NAME, prompt="hello world, ", max_tokens=50, stop="world")
    assert result.choices[0].text == "hello "
    assert result.choices[0].finish_reason == "stop"


async def test_chat(client: AsyncOpenAI, frontend: Frontend) -> None:
    result = await client.chat.completions.create(model=MODEL_NAME, max_tokens=7,
                                                  messages=[{"role": "user", "content": "hi 🙂"}])
    prompt_ids = _chat_prompt_ids(frontend, [("user", "hi 🙂")])
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content == _expected(frontend, prompt_ids, 7)
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.prompt_tokens == len(prompt_ids)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")


async def test_chat_stream_with_logprobs(client: AsyncOpenAI, frontend: Frontend) -> None:
    stream = await client.chat.completions.create(
        model=MODEL_NAME, max_completion_tokens=5, stream=True, logprobs=True, top_logprobs=2,
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    prompt_ids = _chat_prompt_ids(frontend, [("system", "be brief"), ("user", "hi")])
    assert content == _expected(frontend, prompt_ids, 5)  # both messages go through the template
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert len(entries) == 5
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_sse_framing_ends_with_done(http_url: str, fake: FakeScheduler) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "stream": True}
    headers = {"X-Request-Id": "abc", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    async with aiohttp.ClientSession() as session, \
            session.post(http_url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert [p["choices"][0]["finish_reason"] for p in payloads] == [None, None, None, "length"]
    assert all("usage" not in p for p in payloads)
    assert {p["id"] for p in payloads} == {"cmpl-abc"}
    assert (fake.added[0].request_id, fake.added[0].traceparent) == ("abc", headers["traceparent"])


async def test_models(client: AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


async def test_health_is_503_until_the_scheduler_is_ready(tokenizer_dir: Path, fake: FakeScheduler,
                                                          scheduler_addr: str) -> None:
    fake.ready = False
    server = Frontend(make_config(tokenizer_dir, scheduler_addr))
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://{server.http_address}"
            await asyncio.sleep(0.2)
            async with session.get(url + "/health") as resp:
                assert resp.status == 503
            async with session.post(url + "/v1/completions", json={"prompt": "hi"}) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["type"] == "service_unavailable_error"
            fake.ready = True
            await server.scheduler.wait_ready(10)
            async with session.get(url + "/health") as resp:
                assert resp.status == 200
    finally:
        await server.stop(0)


async def test_client_disconnect_during_stream_aborts_the_request(http_url: str, fake: FakeScheduler) -> None:
    fake.step_interval_s = 0.01
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 100, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(http_url + "/v1/completions", json=body)
        await resp.content.readline()  # the first event arrived: the request is running
        resp.close()  # drop the connection mid-stream
    assert await fake.wait_for_abort() == [fake.added[0].request_id]
    assert not fake.running


async def test_client_disconnect_before_any_output_aborts_the_request(http_url: str, fake: FakeScheduler) -> None:
    fake.step_interval_s = 0.5  # the first step comes long after the client is gone
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 100}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(http_url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.1))
    assert await fake.wait_for_abort() == [fake.added[0].request_id]
