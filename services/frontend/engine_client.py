"""The generate pipeline both APIs share: validate -> tokenize -> submit -> stream outputs.

`prepare` does everything that can fail before a request is accepted (so the HTTP app can
answer 4xx before it starts an event stream); `run` submits it and yields one chunk per step
and a final `GenerateComplete`. Leaving `run` early (client gone, cancellation) aborts the
request in the scheduler.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.frontend.config import FrontendConfig
from services.frontend.generation_defaults import GenerationDefaults
from services.frontend.limits import check_generate_sizes, check_text, effective_timeout_s
from services.frontend.messages import (
    AddRequest,
    GenerateEvent,
    GenerateInput,
    ModelCard,
    SchedulerInfo,
    TokenizeResult,
)
from services.frontend.output_processor import OutputProcessor
from services.frontend.rate_limit import RateLimiter
from services.frontend.telemetry import FrontendTelemetry, RequestTelemetry
from services.frontend.tokenizer import Tokenizer
from services.frontend.validation import (
    INT32,
    check_model,
    check_prompt,
    check_request_id,
    check_sampling,
    resolve_sampling,
)

if TYPE_CHECKING:  # the gRPC client is injected; this module never imports grpc
    from services.frontend.scheduler_client import SchedulerClient
from shared.errors import InvalidArgumentError, SpindleError
from shared.types import RequestKind


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized generate request, ready to submit."""

    add: AddRequest
    stop: tuple[str, ...]
    skip_special_tokens: bool
    telemetry: RequestTelemetry
    deadline: float | None  # event-loop time when it is aborted; None: never

    @property
    def request_id(self) -> str:
        return self.add.request_id


class EngineClient:
    """Generation, tokenization and model listing on top of the scheduler connection."""

    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer, scheduler: SchedulerClient,
                 defaults: GenerationDefaults | None = None, telemetry: FrontendTelemetry | None = None,
                 rate_limiter: RateLimiter | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.defaults = defaults or GenerationDefaults()
        self.telemetry = telemetry or FrontendTelemetry(config.served_model_name)
        self.rate_limiter = rate_limiter

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateEvent]:
        """`prepare` then `run`, for callers that need no gap between them."""
        prepared = await self.prepare(request)
        async for event in self.run(prepared):
            yield event

    async def prepare(self, request: GenerateInput) -> PreparedRequest:
        """Validate and tokenize; raises a typed error naming the bad field."""
        operation = "chat" if request.messages is not None else "text_completion"
        telemetry = self.telemetry.start(operation, request.traceparent)
        try:
            return await self._prepare(request, telemetry)
        except BaseException as exc:
            telemetry.fail(exc)
            raise

    async def _prepare(self, request: GenerateInput, telemetry: RequestTelemetry) -> PreparedRequest:
        limits = self.config.limits
        with telemetry.phase("validate"):
            check_model(request.model, self.model_name)
            if self.rate_limiter is not None:
                await self.rate_limiter.check(request.api_key_id)
            check_request_id(request.request_id)
            INT32.check(request.priority, "priority")
            check_generate_sizes(request, limits)
            info = await self.scheduler.get_info()
            if info.task != RequestKind.GENERATE:
                raise InvalidArgumentError(
                    f"model {self.model_name!r} does not support text generation (task {info.task.name.lower()})"
                )
            check_sampling(request.sampling, info.vocab_size, limits)
        with telemetry.phase("tokenize"):
            prompt_token_ids = await self._prompt_token_ids(request)
        with telemetry.phase("validate_prompt"):
            check_prompt(prompt_token_ids, info, limits.max_prompt_tokens)
            options = resolve_sampling(request.sampling, len(prompt_token_ids), info, self.defaults,
                                       self.config.default_max_tokens)
        timeout_s = effective_timeout_s(self.config.request_timeout_s, request.timeout_s)
        add = AddRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=prompt_token_ids,
            sampling=options,
            priority=request.priority,
            traceparent=telemetry.traceparent,
            # The scheduler aborts it at the deadline too, so its blocks are freed even if
            # this frontend is gone by then.
            deadline_unix_s=time.time() + timeout_s if timeout_s is not None else 0.0,
        )
        telemetry.accepted(add)
        deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s is not None else None
        return PreparedRequest(add, tuple(request.sampling.stop), request.skip_special_tokens, telemetry, deadline)

    async def run(self, prepared: PreparedRequest) -> AsyncIterator[GenerateEvent]:
        """Submit and stream: a `GenerateChunk` per step with new output, then a `GenerateComplete`."""
        add, telemetry = prepared.add, prepared.telemetry
        processor = OutputProcessor(add.request_id, self.tokenizer.decode, self.tokenizer.token_text,
                                    add.prompt_token_ids, add.sampling, prepared.stop,
                                    prepared.skip_special_tokens)
        deadline = prepared.deadline
        try:
            async with self.scheduler.submit(add) as stream:
                while not processor.is_finished:
                    try:
                        async with asyncio.timeout_at(deadline):
                            updates = await anext(stream)
                    except TimeoutError:
                        chunk = processor.abort()
                    else:
                        started = time.perf_counter()
                        chunk = processor.process(updates)
                        if chunk is not None:
                            telemetry.on_chunk(chunk, time.perf_counter() - started)
                    if chunk is not None:
                        yield chunk
            complete = processor.complete()
        except BaseException as exc:
            # A failed request, or a client that left (GeneratorExit / cancellation): an abort.
            if isinstance(exc, SpindleError):
                telemetry.fail(exc)
            else:
                telemetry.finish(processor.abort_complete())
            raise
        telemetry.finish(complete)
        yield complete

    async def _prompt_token_ids(self, request: GenerateInput) -> list[int]:
        if request.messages is not None:
            if not request.messages:
                raise InvalidArgumentError("messages is empty: it must contain at least one message")
            return await self.tokenizer.encode_chat(request.messages)
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if not request.prompt_text:
            raise InvalidArgumentError("prompt is empty: it must contain at least one token")
        return await self.tokenizer.encode(request.prompt_text, request.add_special_tokens)

    async def tokenize(self, model: str, text: str, add_special_tokens: bool) -> TokenizeResult:
        check_model(model, self.model_name)
        check_text(text, self.config.limits, "text")
        return await self.tokenizer.tokenize(text, add_special_tokens)

    async def list_models(self) -> list[ModelCard]:
        info: SchedulerInfo = await self.scheduler.get_info()
        return [ModelCard(self.model_name, info.task, info.max_model_len)]
