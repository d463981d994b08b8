"""HTTP routes for prefill-only models: /v1/embeddings (OpenAI), /v1/score and /v1/rerank (vLLM-style).

Parse the body (typed field access from openai_protocol), one PoolingClient call, format.
"""

from __future__ import annotations

import base64
import functools
import json
import time
import uuid

import numpy as np
from aiohttp import web

from services.frontend.http_auth import api_key_id
from services.frontend.messages import EmbedInput, ScoreInput, Usage
from services.frontend.openai_protocol import JsonObject, is_int_list, read_json, type_name
from services.frontend.pooling import PoolingClient, rank
from services.frontend.validation import quote
from shared.errors import InvalidArgumentError

POOLING = web.AppKey("pooling", PoolingClient)



@functools.lru_cache(maxsize=16)
def _values_format(num_values: int) -> str:
    """'%.9g,%.9g,...': one % operation formats a whole vector (a model has one or two sizes)."""
    return ",".join(["%.9g"] * num_values)


def float32_json_array(vector: list[float]) -> str:
    """A vector of float32 values (the worker's output) as a JSON array, each value in 9 significant
    digits: enough to give back every float32 exactly, and written by one % operation over the
    whole vector: 384 values in ~50 us, against ~165 for json's 17-digit float64 repr and ~117
    for a join of one f-string a value (a tenth of a frontend's CPU per one-sentence request).
    NaN and infinities, which JSON cannot spell, go through json as json writes them."""
    text = _values_format(len(vector)) % tuple(vector)
    return f"[{text}]" if "n" not in text else json.dumps(vector)  # only nan and inf hold an "n"


# How /v1/embeddings encodes each vector: as a JSON fragment.
ENCODINGS = {
    "float": float32_json_array,
    "base64": lambda vector: json.dumps(base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()),
}


def _usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}


def parse_embeddings(data: object) -> tuple[EmbedInput, str]:
    """An OpenAI embeddings body: input is a string, strings, token ids, or lists of token ids."""
    body = JsonObject(data)
    encoding = body.get_str("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise InvalidArgumentError(f"encoding_format={quote(encoding)} is not supported; use one of "
                                   f"{sorted(ENCODINGS)}")
    body.reject_if("dimensions", True, "dimensions is not supported")
    raw = body.raw("input")
    request = EmbedInput(model=body.get_str("model") or "", truncate=body.get_bool("truncate"),
                         priority=body.get_int("priority") or 0)
    if body.raw("normalize") is not None:
        request.normalize = body.get_bool("normalize")
    if isinstance(raw, str):
        request.texts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        request.texts = raw
    elif is_int_list(raw):
        request.token_ids = [raw] if raw else []  # type: ignore[list-item]
    elif isinstance(raw, list) and all(is_int_list(x) for x in raw):
        request.token_ids = raw  # type: ignore[assignment]
    else:
        raise InvalidArgumentError(f"input must be a string, a list of strings or token ids, got {type_name(raw)}")
    if request.token_ids == [] or request.texts == []:
        raise InvalidArgumentError("input is empty: give at least one text")
    return request, encoding


async def embeddings(request: web.Request) -> web.Response:
    embed, encoding = parse_embeddings(await read_json(request))
    embed.traceparent = request.headers.get("traceparent", "")
    embed.api_key_id = api_key_id(request)
    result = await request.app[POOLING].embed(embed)
    encode = ENCODINGS[encoding]
    data = ",".join(f'{{"object":"embedding","index":{i},"embedding":{encode(v)}}}'
                    for i, v in enumerate(result.vectors))
    model, usage = json.dumps(request.app[POOLING].model_name), json.dumps(_usage(result.usage))
    return web.Response(text=f'{{"object":"list","data":[{data}],"model":{model},"usage":{usage}}}',
                        content_type="application/json")


def _texts(body: JsonObject, name: str) -> list[str]:
    values = body.str_or_str_list(name)
    if values is None:
        raise InvalidArgumentError(f"{name} is required")
    return values


def _score_input(request: web.Request, body: JsonObject, pairs: list[tuple[str, str]]) -> ScoreInput:
    return ScoreInput(model=body.get_str("model") or "", pairs=pairs, truncate=body.get_bool("truncate"),
                      priority=body.get_int("priority") or 0, traceparent=request.headers.get("traceparent", ""),
                      api_key_id=api_key_id(request))


async def score(request: web.Request) -> web.Response:
    """{"text_1": query(s), "text_2": document(s)}: one query against many, or pairwise lists."""
    body = JsonObject(await read_json(request))
    queries, documents = _texts(body, "text_1"), _texts(body, "text_2")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise InvalidArgumentError(f"text_1 has {len(queries)} texts and text_2 {len(documents)}: give one text_1, "
                                   "or as many as text_2")
    pooling = request.app[POOLING]
    result = await pooling.score(_score_input(request, body, list(zip(queries, documents, strict=True))))
    data = [{"index": i, "object": "score", "score": v[0]} for i, v in enumerate(result.vectors)]
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": pooling.model_name, "data": data, "usage": _usage(result.usage)})


async def rerank(request: web.Request) -> web.Response:
    """{"query", "documents", "top_n"}: documents ranked by relevance, best first."""
    body = JsonObject(await read_json(request))
    query = body.get_str("query")
    if query is None:
        raise InvalidArgumentError("query is required")
    documents = _texts(body, "documents")
    pooling = request.app[POOLING]
    result = await pooling.score(_score_input(request, body, [(query, d) for d in documents]))
    ranked = rank([v[0] for v in result.vectors], sort=True, top_n=body.get_int("top_n") or 0)
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": s} for i, s in ranked]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": pooling.model_name,
                              "usage": {"total_tokens": result.usage.prompt_tokens}, "results": results})


def add_routes(app: web.Application, pooling: PoolingClient) -> None:
    app[POOLING] = pooling
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/score", score)
    app.router.add_post("/v1/rerank", rerank)
