"""Dataclasses the frontend's core speaks: requests in, per-step outputs out, scheduler updates.

`wire.py` converts them to and from generation.proto / scheduler.proto; the HTTP app builds
them from OpenAI JSON. Nothing here imports grpc or protobuf.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.errors import SpindleError
from shared.execute import MultiModalItem
from shared.grammar import Grammar
from shared.sampling import SamplingOptions
from shared.types import RequestKind, StopReason

if TYPE_CHECKING:
    from services.frontend.tools import ToolRequest


class FinishReason(enum.Enum):
    """Why a generation ended, as clients see it (values are the OpenAI strings)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled, deadline, shutdown
    TOOL_CALLS = "tool_calls"  # chat: the answer is function calls (set by the chat formatter)


@dataclass(slots=True, frozen=True)
class SchedulerInfo:
    """What GetSchedulerInfo reports about the served model."""

    ready: bool
    model_id: str
    task: RequestKind
    max_model_len: int
    vocab_size: int
    num_workers: int = 1
    num_kv_blocks: int = 0
    block_size: int = 0
    max_request_tokens: int = 0  # 0: unknown, only max_model_len limits a request
    mm_tokens_per_item: int = 0  # feature tokens per image; 0: the model takes no images
    limit_mm_per_prompt: int = 0  # most images per request
    normalizes_embeddings: bool = False  # the scheduler passes AddRequest.normalize to its workers
    step_port: int = 0  # the scheduler's step socket (shared/step_frames.py); 0: Connect over gRPC only
    step_local_socket: str = ""  # the same on a local socket (shared/step_listener.py); "": none

    @property
    def max_total_tokens(self) -> int:
        """The most prompt plus output tokens one request may use."""
        if self.max_request_tokens > 0:
            return min(self.max_model_len, self.max_request_tokens)
        return self.max_model_len


@dataclass(slots=True)
class AddRequest:
    """A validated, tokenized request handed to the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    kind: RequestKind = RequestKind.GENERATE
    priority: int = 0
    token_type_ids: list[int] = field(default_factory=list)
    traceparent: str = ""
    deadline_unix_s: float = 0.0  # 0: none
    output_token_ids: list[int] = field(default_factory=list)  # already delivered (a re-submission)
    resumed: bool = False  # re-submitted after a reconnect: replaces the scheduler's copy
    shares_prompt_with: str = ""  # a later sample of an n > 1 request: the first sample's id
    mm_items: list[MultiModalItem] = field(default_factory=list)  # images, in prompt order
    normalize: bool = False  # embed requests: the worker L2-normalises the vector


@dataclass(slots=True)
class RequestUpdate:
    """Everything that happened to one request in one engine step (scheduler.proto RequestUpdate)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # [len(token_ids)] when requested
    num_top_logprobs: int = 0
    top_token_ids: list[int] = field(default_factory=list)  # [len(token_ids) * num_top_logprobs]
    top_logprobs: list[float] = field(default_factory=list)  # [len(token_ids) * num_top_logprobs]
    stop_reason: StopReason | None = None  # set on the last update
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    pooled: list[float] = field(default_factory=list)
    error: SpindleError | None = None  # the request failed; it is finished

    @property
    def is_final(self) -> bool:
        return self.stop_reason is not None or self.error is not None


@dataclass(slots=True, frozen=True)
class SamplingRequest:
    """Sampling and stopping as a client sent them; None means "use the default"."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: chosen token plus top N
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) as the client sent them
    grammar: Grammar | None = None  # structured output (response_format, gRPC `structured`)


# Where an image goes in a chat message's text; replaced by the model's image token before the
# chat template runs (a private-use character no tokenizer gives meaning to).
IMAGE_MARKER = "\ue000"


@dataclass(slots=True, frozen=True)
class ChatMessage:
    """One chat turn; content is text, with `IMAGE_MARKER` where each of `images` goes."""

    role: str
    content: str
    images: tuple[str, ...] = ()  # image URLs (data: or http(s):), in content order
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's function calls
    tool_call_id: str = ""  # a tool turn: the call it answers
    name: str = ""  # a tool turn: the function's name, when the client gives it

    def to_template(self) -> dict[str, object]:
        """The message as chat templates expect it (tool-call arguments as objects, as HF templates use them)."""
        message: dict[str, object] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments_for_template()}} for c in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One function call: in an assistant turn of the request, or parsed from the output."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI carries it

    def arguments_for_template(self) -> object:
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


@dataclass(slots=True)
class GenerateInput:
    """A generate request from either API; exactly one of the three prompt forms is set."""

    model: str = ""
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    priority: int = 0
    request_id: str = ""  # empty: the frontend assigns one
    timeout_s: float | None = None  # the client's deadline (gRPC), in seconds from arrival; None: none
    add_special_tokens: bool = True  # for a text prompt (BOS); chat templates carry their own
    skip_special_tokens: bool = True  # in the output text
    traceparent: str = ""
    api_key_id: str = ""  # the authenticated key's id (shared/api_keys.py), never the key; "": keys off
    n: int = 1  # choices to return
    best_of: int | None = None  # candidates to generate, the n most likely returned; None: n
    echo: bool = False  # the prompt's text comes first in each choice (an `is_prompt` chunk)
    images: list[str | bytes] = field(default_factory=list)  # URLs or image bytes, in prompt order
    tools: ToolRequest | None = None  # chat: the functions the model may call (tools.py)


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(slots=True, frozen=True)
class PositionLogprobs:
    """The chosen token's log probability and the top alternatives, most likely first."""

    chosen: TokenLogprob
    top: list[TokenLogprob]


@dataclass(slots=True)
class GenerateChunk:
    """New output of one engine step (or of several, when the client fell behind)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None = None  # one per token id, when requested
    index: int = 0  # the choice (sample) it belongs to
    is_prompt: bool = False  # echo: the prompt's tokens and text, before any output of the choice


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(slots=True)
class GenerateComplete:
    """The last event of a generation."""

    request_id: str
    finish_reason: FinishReason
    usage: Usage
    matched_stop: str | None = None  # the stop string, or the stop token's text
    index: int = 0  # the choice (sample) it ends; a request with n choices ends with n of these
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when computed
    # On the request's last GenerateComplete only: the whole request's usage (the prompt counted
    # once, every sample's output, best_of candidates not returned included).
    total_usage: Usage | None = None


GenerateEvent = GenerateChunk | GenerateComplete


@dataclass(slots=True, frozen=True)
class ModelCard:
    id: str
    task: RequestKind
    max_model_len: int


@dataclass(slots=True, frozen=True)
class TokenizeResult:
    token_ids: list[int]
    tokens: list[str]  # the text piece of each token


@dataclass(slots=True)
class EmbedInput:
    """Texts (or token id lists) to embed, one vector each."""

    model: str = ""
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    truncate: bool = False  # cut over-long inputs instead of rejecting them
    normalize: bool | None = None  # None: as the model is configured
    priority: int = 0
    timeout_s: float | None = None  # as in GenerateInput
    traceparent: str = ""
    api_key_id: str = ""  # as in GenerateInput


@dataclass(slots=True)
class ScoreInput:
    """(query, document) pairs to score with a cross-encoder."""

    model: str = ""
    pairs: list[tuple[str, str]] = field(default_factory=list)
    truncate: bool = False
    priority: int = 0
    timeout_s: float | None = None  # as in GenerateInput
    traceparent: str = ""
    api_key_id: str = ""  # as in GenerateInput


@dataclass(slots=True)
class PoolingResult:
    vectors: list[list[float]]  # embeddings, or [score] per pair
    usage: Usage
