"""vLLM's /tokenize and /detokenize on the frontend's HTTP server (fake scheduler, real tokenizer)."""

from __future__ import annotations

import aiohttp
import pytest

from services.frontend.server import Frontend
from tests.frontend.conftest import MODEL_NAME


async def _post(frontend: Frontend, path: str, body: object) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(f"http://{frontend.http_address}{path}",
                                                                json=body) as resp:
        return resp.status, await resp.json()


async def test_tokenize_prompt_and_messages_like_a_request_would(frontend: Frontend) -> None:
    hf = frontend.tokenizer.hf
    status, body = await _post(frontend, "/tokenize", {"model": MODEL_NAME, "prompt": "hello 数据",
                                                       "return_token_strs": True})
    assert status == 200
    assert body["tokens"] == hf.encode("hello 数据") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 128 and len(body["token_strs"]) == body["count"]
    status, bare = await _post(frontend, "/tokenize", {"prompt": "hello", "add_special_tokens": False})
    assert bare["tokens"] == hf.encode("hello", add_special_tokens=False) and bare["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}]
    for generation_prompt in (True, False):
        status, chat = await _post(frontend, "/tokenize", {"model": MODEL_NAME, "messages": messages,
                                                           "add_generation_prompt": generation_prompt})
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert status == 200 and chat["tokens"] == hf.encode(text, add_special_tokens=False)


async def test_detokenize_round_trips(frontend: Frontend) -> None:
    ids = frontend.tokenizer.hf.encode("round trip")
    status, body = await _post(frontend, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
    assert status == 200 and body == {"prompt": frontend.tokenizer.hf.decode(ids)}


@pytest.mark.parametrize("path, body, status, message", [
    ("/tokenize", {"model": MODEL_NAME}, 400, "prompt (a string) or messages is required"),
    ("/tokenize", {"prompt": 5}, 400, "prompt must be a string"),
    ("/tokenize", {"messages": "hi"}, 400, "messages must be a list"),
    ("/tokenize", {"messages": []}, 400, "messages is empty"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model 'nope' does not exist"),
    ("/detokenize", {"model": MODEL_NAME}, 400, "tokens (a list of token ids) is required"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens must be a list of integers"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens[0]=1000000 is not a valid token id"),
])
async def test_bad_tokenize_requests_are_clear_errors(frontend: Frontend, path: str, body: object, status: int,
                                                      message: str) -> None:
    got_status, got = await _post(frontend, path, body)
    assert got_status == status and message in got["error"]["message"]
