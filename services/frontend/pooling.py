"""Prefill-only requests: embeddings and cross-encoder scores through the scheduler.

Validation early (inputs, model task, lengths), tokenization late (one batched call off the
loop), then every input goes to the scheduler as its own request in one AddRequests message;
the pooled vectors come back on the final updates. L2 normalisation is decided here (the
sentence-transformers config's Normalize module sets the default, a request may say otherwise)
and done by the worker for a whole round at once (`AddRequest.normalize`); only behind a
scheduler that does not pass the flag on (an older one, mid-upgrade) is it done here. This
module applies the rest of the model's post-processing: a sigmoid over a single-label
cross-encoder's logit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.frontend.limits import RequestLimits, check_size, check_texts, effective_timeout_s
from services.frontend.messages import (
    AddRequest,
    EmbedInput,
    PoolingResult,
    RequestUpdate,
    SchedulerInfo,
    ScoreInput,
    Usage,
)
from services.frontend.rate_limit import RateLimiter
from services.frontend.telemetry import FrontendTelemetry, RequestTelemetry
from services.frontend.tokenizer import Encoded, Tokenizer
from services.frontend.validation import INT32, check_model, check_token_ids

if TYPE_CHECKING:  # the gRPC client is injected; this module never imports grpc
    from services.frontend.scheduler_client import RequestStream, SchedulerClient
from shared.errors import DeadlineExceededError, InternalError, InvalidArgumentError
from shared.sampling import SamplingOptions
from shared.types import RequestKind, StopReason

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
    """Embed and Score on top of the scheduler connection.

    Args:
        limits: per-request limits (input count and lengths), checked before tokenizing.
        request_timeout_s: a request still running after this long fails (0: never); a
            client's shorter deadline wins.
    """

    def __init__(self, model_name: str, tokenizer: Tokenizer, scheduler: SchedulerClient,
                 normalize_default: bool = False, telemetry: FrontendTelemetry | None = None,
                 limits: RequestLimits | None = None, request_timeout_s: float = 0.0,
                 rate_limiter: RateLimiter | None = None) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.normalize_default = normalize_default
        self.telemetry = telemetry or FrontendTelemetry(model_name)
        self.rate_limiter = rate_limiter
        self.limits = limits or RequestLimits()
        self.request_timeout_s = request_timeout_s

    async def embed(self, request: EmbedInput) -> PoolingResult:
        return await self._traced("embeddings", request.traceparent, request.api_key_id,
                                  lambda t: self._embed(request, t))

    async def score(self, request: ScoreInput) -> PoolingResult:
        return await self._traced("score", request.traceparent, request.api_key_id,
                                  lambda t: self._score(request, t))

    async def _traced(self, operation: str, traceparent: str, api_key_id: str,
                      work: Callable[[RequestTelemetry], Awaitable[PoolingResult]]) -> PoolingResult:
        """Run `work` inside one request span; its inputs' scheduler requests are its children."""
        telemetry = self.telemetry.start(operation, traceparent)
        try:
            if self.rate_limiter is not None:
                await self.rate_limiter.check(api_key_id)
            result = await work(telemetry)
        except BaseException as exc:
            telemetry.fail(exc)
            raise
        telemetry.finish_with("stop", result.usage)
        return result

    async def _embed(self, request: EmbedInput, telemetry: RequestTelemetry) -> PoolingResult:
        info = await self._check_request(request.model, RequestKind.EMBED, request.priority)
        limit = self._token_limit(info)
        if request.token_ids is not None:
            check_size(len(request.token_ids), self.limits.max_batch_inputs, "number of inputs", "max_batch_inputs")
            encoded = [_check_ids(ids, i, info.vocab_size, limit, request.truncate)
                       for i, ids in enumerate(request.token_ids)]
        else:
            texts = _non_empty(request.texts or [], "input")
            check_texts(texts, self.limits, "input")
            encoded = await self.tokenizer.encode_batch(texts, limit.num_tokens if request.truncate else None)
        _check_lengths(encoded, limit, "input")
        normalize = request.normalize if request.normalize is not None else self.normalize_default
        by_worker = normalize and info.normalizes_embeddings
        result = await self._run(RequestKind.EMBED, encoded, request, telemetry.traceparent, by_worker)
        if normalize and not by_worker:  # an older scheduler would drop the flag: normalise here
            result.vectors = [_l2_normalize(v) for v in result.vectors]
        return result

    async def _score(self, request: ScoreInput, telemetry: RequestTelemetry) -> PoolingResult:
        info = await self._check_request(request.model, RequestKind.SCORE, request.priority)
        if not request.pairs:
            raise InvalidArgumentError("documents is empty: give at least one document to score")
        for field, texts in (("query", [q for q, _ in request.pairs]), ("documents", [d for _, d in request.pairs])):
            check_texts(_non_empty(texts, field), self.limits, field)
        limit = self._token_limit(info)
        encoded = await self.tokenizer.encode_pairs(request.pairs, limit.num_tokens if request.truncate else None)
        _check_lengths(encoded, limit, "documents")
        result = await self._run(RequestKind.SCORE, encoded, request, telemetry.traceparent)
        result.vectors = [[_sigmoid(v[0])] if len(v) == 1 else v for v in result.vectors]
        return result

    def _token_limit(self, info: SchedulerInfo) -> _TokenLimit:
        if info.max_total_tokens <= self.limits.max_prompt_tokens:
            return _TokenLimit(info.max_total_tokens, "the model's limit")
        return _TokenLimit(self.limits.max_prompt_tokens, "the limit (max_prompt_tokens)")

    async def _check_request(self, model: str, task: RequestKind, priority: int) -> SchedulerInfo:
        check_model(model, self.model_name)
        INT32.check(priority, "priority")
        info = await self.scheduler.get_info()
        if info.task != task:
            raise InvalidArgumentError(f"model {self.model_name!r} does not support {TASK_NAMES[task]} "
                                       f"(it serves {TASK_NAMES[info.task]})")
        return info

    async def _run(self, kind: RequestKind, encoded: list[Encoded], request: EmbedInput | ScoreInput,
                   traceparent: str, normalize: bool = False) -> PoolingResult:
        """Submit every input (one batched message), wait for all pooled outputs, in input order;
        `normalize`: the worker L2-normalises each vector (one op over its round: 39 us for 32
        vectors of 384, where `_l2_normalize` takes 22 us a vector)."""
        batch_id = uuid.uuid4().hex
        streams: list[RequestStream] = []
        timeout_s = effective_timeout_s(self.request_timeout_s, request.timeout_s)
        # The scheduler drops the inputs at the deadline too, even if this frontend is gone by then.
        deadline_unix_s = time.time() + timeout_s if timeout_s is not None else 0.0
        try:
            for i, item in enumerate(encoded):
                streams.append(self.scheduler.submit(AddRequest(
                    request_id=f"{kind.name.lower()}-{batch_id}-{i}", prompt_token_ids=item.token_ids,
                    sampling=SamplingOptions(max_tokens=1), kind=kind, priority=request.priority,
                    token_type_ids=item.token_type_ids, traceparent=traceparent, deadline_unix_s=deadline_unix_s,
                    normalize=normalize)))
            async with asyncio.timeout(timeout_s):
                finals = await asyncio.gather(*(_final_update(s) for s in streams))
        except TimeoutError as exc:
            raise _deadline_error(timeout_s) from exc
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
        if final.stop_reason is StopReason.ABORTED:  # the scheduler's deadline passed first
            raise _deadline_error(None)
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


def _deadline_error(timeout_s: float | None) -> DeadlineExceededError:
    within = f" within its deadline of {timeout_s:g} s" if timeout_s is not None else " within its deadline"
    return DeadlineExceededError(f"the request did not finish{within}")


@dataclass(frozen=True, slots=True)
class _TokenLimit:
    """The most tokens one input may have, and which limit that is (for the error message)."""

    num_tokens: int
    name: str


def _check_ids(ids: list[int], index: int, vocab_size: int, limit: _TokenLimit, truncate: bool) -> Encoded:
    """A token-id input: non-empty, cut or checked to `limit` (before its ids are looked at), valid ids."""
    if not ids:
        raise InvalidArgumentError(f"input[{index}] is empty")
    ids = ids[: limit.num_tokens] if truncate else ids
    _check_length(len(ids), limit, f"input[{index}]")
    check_token_ids(ids, vocab_size, f"input[{index}]")
    return Encoded(ids, [])


def _check_lengths(encoded: list[Encoded], limit: _TokenLimit, name: str) -> None:
    for i, item in enumerate(encoded):
        _check_length(len(item.token_ids), limit, f"{name}[{i}]")


def _check_length(num_tokens: int, limit: _TokenLimit, field: str) -> None:
    if num_tokens > limit.num_tokens:
        raise InvalidArgumentError(f"{field} has {num_tokens} tokens, more than {limit.name} of {limit.num_tokens} "
                                   "tokens; shorten it or set truncate")


def _l2_normalize(vector: list[float]) -> list[float]:
    """Behind a scheduler without `normalizes_embeddings` only; otherwise the worker does it."""
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
