"""The generate pipeline both APIs share: validate -> tokenize -> submit -> stream outputs.

`prepare` does everything that can fail before a request is accepted (so the HTTP app can
answer 4xx before it starts an event stream); `run` submits it and yields one chunk per step
and a final `GenerateComplete`. Leaving `run` early (client gone, cancellation) aborts the
request in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.frontend.best_of import pick_best
from services.frontend.config import FrontendConfig
from services.frontend.generation_defaults import GenerationDefaults
from services.frontend.grammar_check import GrammarChecker
from services.frontend.image_inputs import image_inputs
from services.frontend.limits import check_generate_sizes, check_size, check_text, effective_timeout_s
from services.frontend.messages import (
    AddRequest,
    ChatMessage,
    GenerateChunk,
    GenerateComplete,
    GenerateEvent,
    GenerateInput,
    ModelCard,
    SchedulerInfo,
    TokenizeResult,
)
from services.frontend.output_processor import OutputProcessor
from services.frontend.rate_limit import RateLimiter
from services.frontend.samples import merge, sample_requests, total_usage, with_total_usage
from services.frontend.telemetry import FrontendTelemetry, RequestTelemetry
from services.frontend.tokenizer import Tokenizer
from services.frontend.tools import generic_messages, template_knows_tools
from services.frontend.validation import (
    INT32,
    check_model,
    check_prompt,
    check_request_id,
    check_samples,
    check_sampling,
    check_token_ids,
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
    n: int = 1  # choices returned
    num_samples: int = 1  # samples generated: n, or best_of
    logprobs_wanted: bool = False  # the client asked for logprobs (best_of may request them only to rank)
    echo_text: str | None = None  # echo: the prompt's text, sent first in each choice

    @property
    def request_id(self) -> str:
        return self.add.request_id


@dataclass(slots=True)
class _Sample:
    """One sample of a request in flight: what was submitted and its output processor."""

    index: int
    add: AddRequest
    processor: OutputProcessor


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
        self.system_fingerprint = _fingerprint(config.served_model_name, config.model)
        self.grammars = GrammarChecker(tokenizer.hf, tokenizer.run_exclusive)

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
            check_samples(request.n, request.best_of)
            if request.sampling.grammar is not None:
                await self.grammars.check(request.sampling.grammar)
        with telemetry.phase("tokenize"):
            prompt_token_ids = await self._prompt_token_ids(request)
        mm_items = []
        if request.images:
            with telemetry.phase("images"):
                prompt_token_ids, mm_items = await image_inputs(self.config.model).process(
                    request.images, prompt_token_ids, info, limits, self.tokenizer.hf.bos_token_id)
        with telemetry.phase("validate_prompt"):
            check_prompt(prompt_token_ids, info, limits.max_prompt_tokens)
            options = resolve_sampling(request.sampling, len(prompt_token_ids), info, self.defaults,
                                       self.config.default_max_tokens)
        num_samples = request.best_of or request.n
        if num_samples > request.n and options.logprobs is None:
            options = dataclasses.replace(options, logprobs=0)  # best_of ranks candidates by their logprobs
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
            mm_items=mm_items,
        )
        telemetry.accepted(add)
        deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s is not None else None
        echo_text = None
        if request.echo:
            echo_text = (request.prompt_text if request.prompt_text is not None
                         else self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False))
        return PreparedRequest(add, tuple(request.sampling.stop), request.skip_special_tokens, telemetry, deadline,
                               n=request.n, num_samples=num_samples,
                               logprobs_wanted=request.sampling.logprobs is not None, echo_text=echo_text)

    async def run(self, prepared: PreparedRequest) -> AsyncIterator[GenerateEvent]:
        """Submit and stream: `GenerateChunk`s with new output as it comes, and a `GenerateComplete`
        per choice (its `index`); the last one carries the request's `total_usage`.

        With n > 1 the samples' events interleave; with best_of > n they come only at the end,
        the n best candidates' in turn.
        """
        samples = [
            _Sample(i, add, OutputProcessor(prepared.request_id, self.tokenizer.decode, self.tokenizer.token_text,
                                            add.prompt_token_ids, add.sampling, prepared.stop,
                                            prepared.skip_special_tokens, self.tokenizer.token_bytes))
            for i, add in enumerate(sample_requests(prepared.add, prepared.num_samples))
        ]
        telemetry = prepared.telemetry
        if len(samples) == 1:  # its complete carries the total itself: one generator less a token
            events = self._sample_events(prepared, samples[0], alone=True)
        else:
            events = with_total_usage(merge([self._sample_events(prepared, s) for s in samples]), len(samples))
        if prepared.num_samples > prepared.n:
            events = pick_best(events, prepared.n, prepared.logprobs_wanted)
        completes: list[GenerateComplete] = []
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, GenerateComplete):
                        completes.append(event)
                        if event.total_usage is not None:  # the last: count it before a caller stops reading
                            telemetry.finish_with(completes[0].finish_reason.value, event.total_usage)
                    yield event
        except BaseException as exc:
            # A failed request, or a client that left (GeneratorExit / cancellation): an abort.
            if isinstance(exc, SpindleError):
                telemetry.fail(exc)
            else:
                usage = total_usage([s.processor.abort_complete().usage for s in samples])
                telemetry.finish_with("abort", usage)
            raise

    async def _sample_events(self, prepared: PreparedRequest, sample: _Sample,
                             alone: bool = False) -> AsyncIterator[GenerateEvent]:
        """One sample's events: echo, then a chunk per step with new output, then its complete
        (`alone`: the request's only sample, whose complete carries the request's total usage).

        The echo chunk waits for the scheduler's first update, so a request the scheduler
        refuses at once (backpressure) still fails before an HTTP stream has started.
        """
        processor, index, telemetry = sample.processor, sample.index, prepared.telemetry
        echo = prepared.echo_text
        async with self.scheduler.submit(sample.add, prepared.deadline) as stream:
            while not processor.is_finished:
                try:
                    updates = await anext(stream)
                except TimeoutError:
                    chunk = processor.abort()
                else:
                    started = time.perf_counter()
                    chunk = processor.process(updates)  # raises the scheduler's error, if any
                    if chunk is not None:
                        chunk.index = index
                        telemetry.on_chunk(chunk, time.perf_counter() - started)
                if echo is not None:
                    yield GenerateChunk(prepared.request_id, list(sample.add.prompt_token_ids), echo, index=index,
                                        is_prompt=True)
                    echo = None
                if chunk is not None:
                    chunk.index = index  # (an abort's chunk too)
                    yield chunk
        complete = processor.complete()
        complete.index = index
        if alone:
            complete.total_usage = total_usage([complete.usage])
        yield complete

    async def _prompt_token_ids(self, request: GenerateInput) -> list[int]:
        if request.messages is not None:
            if not request.messages:
                raise InvalidArgumentError("messages is empty: it must contain at least one message")
            messages = request.messages
            if request.images:  # the model's image token where each image goes
                messages = image_inputs(self.config.model).with_image_tokens(messages, self.tokenizer.hf)
            if not template_knows_tools(self.tokenizer.chat_template):
                return await self.tokenizer.encode_chat(generic_messages(messages, request.tools))
            tools = request.tools
            return await self.tokenizer.encode_chat(messages, tools=[t.to_openai() for t in tools.tools]
                                                    if tools is not None and tools.is_active else None)
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if not request.prompt_text:
            raise InvalidArgumentError("prompt is empty: it must contain at least one token")
        return await self.tokenizer.encode(request.prompt_text, request.add_special_tokens)

    async def tokenize(self, model: str, text: str, add_special_tokens: bool) -> TokenizeResult:
        check_model(model, self.model_name)
        check_text(text, self.config.limits, "text")
        return await self.tokenizer.tokenize(text, add_special_tokens)

    async def tokenize_chat(self, model: str, messages: list[ChatMessage], add_generation_prompt: bool,
                            add_special_tokens: bool = False) -> TokenizeResult:
        """The token ids a chat request with these messages would have as its prompt."""
        check_model(model, self.model_name)
        check_generate_sizes(GenerateInput(messages=messages), self.config.limits)
        if not messages:
            raise InvalidArgumentError("messages is empty: it must contain at least one message")
        ids = await self.tokenizer.encode_chat(messages, add_generation_prompt, add_special_tokens)
        return TokenizeResult(token_ids=ids, tokens=[self.tokenizer.token_text(i) for i in ids])

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens kept, as vLLM's /detokenize does)."""
        check_model(model, self.model_name)
        check_size(len(token_ids), self.config.limits.max_prompt_tokens, "tokens length", "max_prompt_tokens")
        check_token_ids(token_ids, self.tokenizer.vocab_size, "tokens")
        return await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.decode, token_ids, False)

    async def max_model_len(self) -> int:
        return (await self.scheduler.get_info()).max_model_len

    async def list_models(self) -> list[ModelCard]:
        info: SchedulerInfo = await self.scheduler.get_info()
        return [ModelCard(self.model_name, info.task, info.max_model_len)]


def _fingerprint(served_model_name: str, model_dir: str) -> str:
    """OpenAI's `system_fingerprint`: names the backend configuration that served a response, so a
    client comparing seeded outputs can tell when the server behind them changed (model, version)."""
    from importlib import metadata

    try:
        version = metadata.version("spindle")
    except metadata.PackageNotFoundError:
        version = "dev"
    digest = hashlib.sha256(f"{served_model_name}\0{model_dir}\0{version}".encode()).hexdigest()
    return f"fp_{digest[:10]}"
