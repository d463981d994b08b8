"""vLLM's /tokenize and /detokenize on the OpenAI HTTP server, with vLLM's request and response shapes.

POST /tokenize {"model", "prompt", "add_special_tokens": true} or {"model", "messages",
"add_generation_prompt": true, "add_special_tokens": false} -> {"count", "max_model_len", "tokens",
"token_strs"}; POST /detokenize {"model", "tokens"} -> {"prompt"}. A client counts tokens with
exactly the server's tokenizer and chat template, so it can size prompts before sending them.
"""

from __future__ import annotations

from aiohttp import web

from services.frontend.engine_client import EngineClient
from services.frontend.openai_protocol import JsonObject, parse_message, read_json, type_name
from shared.errors import InvalidArgumentError

ENGINE = web.AppKey("tokenize_engine", EngineClient)


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = JsonObject(await read_json(request))
    model = body.get_str("model") or ""
    raw_messages = body.raw("messages")
    if raw_messages is not None:
        if not isinstance(raw_messages, list):
            raise InvalidArgumentError(f"messages must be a list of messages, got {type_name(raw_messages)}")
        messages = [parse_message(m, i) for i, m in enumerate(raw_messages)]
        result = await engine.tokenize_chat(model, messages, body.get_bool("add_generation_prompt", default=True),
                                            body.get_bool("add_special_tokens"))
    else:
        prompt = body.get_str("prompt")
        if prompt is None:
            raise InvalidArgumentError("prompt (a string) or messages is required")
        result = await engine.tokenize(model, prompt, body.get_bool("add_special_tokens", default=True))
    token_strs = result.tokens if body.get_bool("return_token_strs") else None
    return web.json_response({"count": len(result.token_ids), "max_model_len": await engine.max_model_len(),
                              "tokens": result.token_ids, "token_strs": token_strs})


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = JsonObject(await read_json(request))
    tokens = body.int_list("tokens")
    if tokens is None:
        raise InvalidArgumentError("tokens (a list of token ids) is required")
    return web.json_response({"prompt": await engine.detokenize(body.get_str("model") or "", tokens)})


def add_routes(app: web.Application, engine: EngineClient) -> None:
    app[ENGINE] = engine
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
