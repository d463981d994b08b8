"""Per-request spans, metrics and request logs of the frontend, in one object per request.

`FrontendTelemetry.start` opens a request's span (the child of the client's `traceparent`, or a
new trace) with OpenTelemetry GenAI attributes; `phase` wraps validation and tokenization in
child spans; `on_chunk` times first and later tokens; `finish` / `fail` close the span and count
the request. With tracing off only the metrics work is done (a few counter updates per chunk).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence

from services.frontend.messages import AddRequest, GenerateChunk, GenerateComplete, Usage
from services.frontend.metrics import FrontendMetrics
from shared.errors import SpindleError
from shared.logs import request_extra
from shared.tracing import Span, SpanKind, Tracing, format_traceparent, parse_traceparent

logger = logging.getLogger(__name__)


class FrontendTelemetry:
    """Where a frontend's request telemetry goes: tracer, metrics, and whether to log contents.

    Args:
        model_name: the served model name (`gen_ai.request.model`, the metrics' label).
        tracing: the service's tracer (disabled: no spans).
        metrics: the service's Prometheus metrics.
        log_requests: log prompts and outputs (off by default: they may be private).
    """

    def __init__(self, model_name: str, tracing: Tracing | None = None, metrics: FrontendMetrics | None = None,
                 log_requests: bool = False) -> None:
        self.model_name = model_name
        self.tracing = tracing or Tracing.disabled()
        self.metrics = metrics or FrontendMetrics(model_name)
        self.log_requests = log_requests

    def start(self, operation: str, traceparent: str) -> RequestTelemetry:
        """Open the telemetry of one request; `operation` is the GenAI operation name.

        A malformed `traceparent` is dropped, as W3C trace context says (it came from a client
        header and would otherwise travel to the scheduler as it is).
        """
        if traceparent and parse_traceparent(traceparent) is None:
            traceparent = ""
        span = None
        if self.tracing.enabled:
            span = self.tracing.start_span(f"{operation} {self.model_name}", traceparent, SpanKind.SERVER, {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "spindle",
                "gen_ai.request.model": self.model_name,
            })
        return RequestTelemetry(self, span, traceparent)


class RequestTelemetry:
    """One request's span and timers. Every method is safe to call with tracing off."""

    def __init__(self, owner: FrontendTelemetry, span: Span | None, client_traceparent: str) -> None:
        self._owner = owner
        self._metrics = owner.metrics
        self.span = span
        # What the scheduler receives: this span's context, or the client's when not tracing.
        self.traceparent = format_traceparent(span) if span is not None else client_traceparent
        self.request_id = ""
        self._arrival = time.monotonic()
        self._last_output: dict[int, float] = {}  # per choice (n > 1): inter-token latency is per sequence
        self._detokenize_s = 0.0
        self._output_text: list[str] = []
        self._prompt_token_ids: Sequence[int] = ()
        self._done = False
        self._metrics.requests_in_flight.inc()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A child span around one step of preparing the request (validate, tokenize)."""
        if self.span is None:
            yield
            return
        child = self._owner.tracing.start_span(name, self.traceparent)
        try:
            yield
        except SpindleError as exc:
            Tracing.fail(child, exc.message)
            raise
        finally:
            child.end()

    def accepted(self, add: AddRequest) -> None:
        """The request passed validation and is about to be submitted (pooling: its first input)."""
        self.request_id = add.request_id
        self._prompt_token_ids = add.prompt_token_ids
        if self.span is not None:
            sampling = add.sampling
            self.span.set_attributes({
                "gen_ai.response.id": add.request_id,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.request.top_k": sampling.top_k,
                "gen_ai.usage.input_tokens": len(add.prompt_token_ids),
            })
            if sampling.seed is not None:
                self.span.set_attribute("gen_ai.request.seed", sampling.seed)

    def on_chunk(self, chunk: GenerateChunk, detokenize_s: float) -> None:
        """A chunk of output is on its way to the client."""
        self._detokenize_s += detokenize_s
        if not chunk.token_ids:
            return
        now = time.monotonic()
        last = self._last_output.get(chunk.index)
        if not self._last_output:
            ttft = now - self._arrival
            self._metrics.time_to_first_token.observe(ttft)
            if self.span is not None:
                self.span.add_event("first_token", {"spindle.time_to_first_token_s": ttft})
                self.span.set_attribute("spindle.time_to_first_token_s", ttft)
        elif last is not None:
            self._metrics.inter_token_latency.observe(now - last)
        self._last_output[chunk.index] = now
        if self._owner.log_requests:
            self._output_text.append(chunk.text)

    def finish(self, complete: GenerateComplete) -> None:
        """The request ended normally (stop, length or abort)."""
        self.finish_with(complete.finish_reason.value, complete.usage)

    def finish_with(self, reason: str, usage: Usage) -> None:
        """The request ended with `reason` (an OpenAI finish reason) after using `usage`."""
        if self._done:
            return
        self._done = True
        m = self._metrics
        m.requests_in_flight.dec()
        m.finished(reason)
        m.e2e_latency.observe(time.monotonic() - self._arrival)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        m.request_prompt_tokens.observe(usage.prompt_tokens)
        m.request_generation_tokens.observe(usage.completion_tokens)
        if self.span is not None:
            self.span.set_attributes({
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "gen_ai.response.finish_reasons": [reason],
                "spindle.prefix_cache_hit_tokens": usage.cached_prompt_tokens,
                "spindle.detokenize_s": self._detokenize_s,
            })
            self.span.end()
        extra = request_extra(self.request_id, self.traceparent)
        if self._owner.log_requests:
            logger.info("finished (%s): prompt_token_ids=%s output=%r", reason, list(self._prompt_token_ids),
                        "".join(self._output_text), extra=extra)
        else:
            logger.debug("finished (%s): %d prompt, %d output tokens", reason, usage.prompt_tokens,
                         usage.completion_tokens, extra=extra)

    def fail(self, error: BaseException) -> None:
        """The request was rejected or failed; `error` says why."""
        if self._done:
            return
        self._done = True
        self._metrics.requests_in_flight.dec()
        kind = error.kind.name.lower() if isinstance(error, SpindleError) else type(error).__name__
        self._metrics.failed(kind)
        if self.span is not None:
            message = error.message if isinstance(error, SpindleError) else str(error)
            self.span.set_attribute("error.type", kind)
            Tracing.fail(self.span, message)
            self.span.end()
