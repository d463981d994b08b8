"""Prefill-only requests: embeddings and cross-encoder scores through the scheduler.

Validation early (inputs, model task, lengths), tokenization late (one batched call off the
loop), then every input goes to the scheduler as its own request in one AddRequests message;
the pooled vectors come back on the final updates. The worker returns the model's raw pooled
output (the embedding; the classifier logits); this module applies the model's
post-processing: L2 normalisation when the sentence-transformers config has a Normalize
module (or the request asks for it), and a sigmoid over a single-label cross-encoder's logit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.frontend.messages import (
    AddRequest,
    EmbedInput,
    PoolingResult,
    RequestUpdate,
    SchedulerInfo,
    ScoreInput,
    Usage,
)
from services.frontend.telemetry import FrontendTelemetry, RequestTelemetry
from services.frontend.tokenizer import Encoded, Tokenizer
from services.frontend.validation import check_model, check_token_ids

if TYPE_CHECKING:  # the gRPC client is injected; this module never imports grpc
    from services.frontend.scheduler_client import RequestStream, SchedulerClient
from shared.errors import InternalError, InvalidArgumentError
from shared.sampling import SamplingOptions
from shared.types import RequestKind

logger = logging.getLogger(__name__)

TASK_NAMES: dict[RequestKind, str] = {
    RequestKind.GENERATE: "text generation",
    RequestKind.EMBED: "embeddings",
    RequestKind.SCORE: "scoring",
}


def model_normalizes(model_dir: str | Path) -> bool:
    """Whether the sentence-transformers pipeline (modules.json) ends in a Normalize module."""
    path = Path(model_dir) / "modules.json"
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return any(isinstance(m, dict) and str(m.get("type", "")).endswith(".Normalize") for m in modules)


class PoolingClient:
    """Embed and Score on top of the scheduler connection."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, scheduler: SchedulerClient,
                 normalize_default: bool = False, telemetry: FrontendTelemetry | None = None) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.normalize_default = normalize_default
        self.telemetry = telemetry or FrontendTelemetry(model_name)

    async def embed(self, request: EmbedInput) -> PoolingResult:
        return await self._traced("embeddings", request.traceparent, lambda t: self._embed(request, t))

    async def score(self, request: ScoreInput) -> PoolingResult:
        return await self._traced("score", request.traceparent, lambda t: self._score(request, t))

    async def _traced(self, operation: str, traceparent: str,
                      work: Callable[[RequestTelemetry], Awaitable[PoolingResult]]) -> PoolingResult:
        """Run `work` inside one request span; its inputs' scheduler requests are its children."""
        telemetry = self.telemetry.start(operation, traceparent)
        try:
            result = await work(telemetry)
        except BaseException as exc:
            telemetry.fail(exc)
            raise
        telemetry.finish_with("stop", result.usage)
        return result

    async def _embed(self, request: EmbedInput, telemetry: RequestTelemetry) -> PoolingResult:
        info = await self._check_task(request.model, RequestKind.EMBED)
        limit = info.max_total_tokens
        if request.token_ids is not None:
            encoded = [_check_ids(ids, i, info, request.truncate) for i, ids in enumerate(request.token_ids)]
        else:
            texts = _non_empty(request.texts or [], "input")
            encoded = await self.tokenizer.encode_batch(texts, limit if request.truncate else None)
        _check_lengths(encoded, limit, "input")
        result = await self._run(RequestKind.EMBED, encoded, request.priority, telemetry.traceparent)
        if request.normalize if request.normalize is not None else self.normalize_default:
            result.vectors = [_l2_normalize(v) for v in result.vectors]
        return result

    async def _score(self, request: ScoreInput, telemetry: RequestTelemetry) -> PoolingResult:
        info = await self._check_task(request.model, RequestKind.SCORE)
        if not request.pairs:
            raise InvalidArgumentError("documents is empty: give at least one document to score")
        _non_empty([q for q, _ in request.pairs], "query")
        _non_empty([d for _, d in request.pairs], "documents")
        limit = info.max_total_tokens
        encoded = await self.tokenizer.encode_pairs(request.pairs, limit if request.truncate else None)
        _check_lengths(encoded, limit, "documents")
        result = await self._run(RequestKind.SCORE, encoded, request.priority, telemetry.traceparent)
        result.vectors = [[_sigmoid(v[0])] if len(v) == 1 else v for v in result.vectors]
        return result

    async def _check_task(self, model: str, task: RequestKind) -> SchedulerInfo:
        check_model(model, self.model_name)
        info = await self.scheduler.get_info()
        if info.task != task:
            raise InvalidArgumentError(f"model {self.model_name!r} does not support {TASK_NAMES[task]} "
                                       f"(it serves {TASK_NAMES[info.task]})")
        return info

    async def _run(self, kind: RequestKind, encoded: list[Encoded], priority: int,
                   traceparent: str) -> PoolingResult:
        """Submit every input (one batched message), wait for all pooled outputs, in input order."""
        batch_id = uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:
            for i, item in enumerate(encoded):
                streams.append(self.scheduler.submit(AddRequest(
                    request_id=f"{kind.name.lower()}-{batch_id}-{i}", prompt_token_ids=item.token_ids,
                    sampling=SamplingOptions(max_tokens=1), kind=kind, priority=priority,
                    token_type_ids=item.token_type_ids, traceparent=traceparent)))
            finals = await asyncio.gather(*(_final_update(s) for s in streams))
        finally:
            for stream in streams:
                stream.close()  # aborts whatever did not finish (an error or a cancellation)
        num_tokens = sum(len(item.token_ids) for item in encoded)
        return PoolingResult([u.pooled for u in finals], Usage(num_tokens, 0, sum(u.num_cached_tokens for u in finals)))


async def _final_update(stream: RequestStream) -> RequestUpdate:
    async for updates in stream:
        final = updates[-1]
        if final.error is not None:
            raise final.error
        if final.is_final:
            if not final.pooled:
                raise InternalError(f"request {stream.request_id} ended without a pooled output "
                                           f"({final.stop_reason})")
            return final
    raise AssertionError("a request stream ended without a final update")


def rank(scores: list[float], sort: bool, top_n: int) -> list[tuple[int, float]]:
    """(index, score) pairs: the best `top_n` (0: all), highest first when `sort`, else in input order."""
    if top_n < 0:
        raise InvalidArgumentError(f"top_n={top_n} must not be negative")
    best = sorted(enumerate(scores), key=lambda pair: -pair[1])[: top_n or None]
    return best if sort else sorted(best)


def _non_empty(texts: list[str], name: str) -> list[str]:
    if not texts:
        raise InvalidArgumentError(f"{name} is empty: give at least one text")
    for i, text in enumerate(texts):
        if not text:
            raise InvalidArgumentError(f"{name}[{i}] is an empty string")
    return texts


def _check_ids(ids: list[int], index: int, info: SchedulerInfo, truncate: bool) -> Encoded:
    if not ids:
        raise InvalidArgumentError(f"input[{index}] is empty")
    check_token_ids(ids, info.vocab_size, f"input[{index}]")
    return Encoded(ids[: info.max_total_tokens] if truncate else ids, [])


def _check_lengths(encoded: list[Encoded], limit: int, name: str) -> None:
    for i, item in enumerate(encoded):
        if len(item.token_ids) > limit:
            raise InvalidArgumentError(
                f"{name}[{i}] has {len(item.token_ids)} tokens, more than the model's limit of {limit} tokens; "
                "shorten it or set truncate"
            )


def _l2_normalize(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
