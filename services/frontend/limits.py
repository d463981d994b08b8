"""`RequestLimits`: how much one client request may ask for, and the checks against it.

Each limit keeps one request from taking the service down for everyone (memory, tokenizer
time, the event loop), so every check here runs before tokenizing (the token count of a text
prompt is the one exception: it exists only after), and fails with INVALID_ARGUMENT / 400
naming the field, the value and the setting. Limits the model sets (context length,
vocabulary) and the wire types' ranges are validation.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from services.frontend.messages import GenerateInput
from services.frontend.validation import MAX_INT32
from shared.errors import InvalidArgumentError


def _limit(default: int, help_text: str) -> Any:
    """A limit field; its help text is the flag's (`__main__` makes one flag per field)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits of one frontend: flag `--max-...` / env `SPINDLE_MAX_...` per field.

    Text lengths count characters; "prompt" texts are a completion prompt, all chat messages
    together (roles included), a Tokenize text, and each embedding input, query or document.
    The model's context length still applies where it is smaller than a token limit.
    """

    max_body_bytes: int = _limit(16 * 2**20, "largest HTTP request body or gRPC request message in bytes; a larger "
                                             "one is answered 413 / RESOURCE_EXHAUSTED")
    max_prompt_chars: int = _limit(2**20, "longest prompt text in characters (chat: all messages together; "
                                          "pooling: each input)")
    max_prompt_tokens: int = _limit(2**17, "most tokens in one prompt or pooling input")
    max_output_tokens: int = _limit(2**15, "largest max_tokens a request may ask for")
    max_messages: int = _limit(1024, "most messages in one chat request")
    max_stop_strings: int = _limit(16, "most stop strings in one request")
    max_stop_string_chars: int = _limit(512, "longest stop string in characters")
    max_stop_token_ids: int = _limit(256, "most stop token ids in one request")
    max_logprobs: int = _limit(20, "most alternatives per position (logprobs, top_logprobs)")
    max_batch_inputs: int = _limit(2048, "most embedding inputs, or documents to score, in one request")
    max_image_bytes: int = _limit(16 * 2**20, "largest image file in bytes (data: URL decoded, or downloaded)")
    max_image_pixels: int = _limit(2**24, "most pixels (width x height) in one image, checked before decoding")
    max_image_fetch_seconds: int = _limit(10, "time limit for downloading one http(s) image URL")

    def __post_init__(self) -> None:
        for f in fields(self):
            name, value = f.name, getattr(self, f.name)
            # NOTE: each limit must fit the wire type of what it bounds (int32 everywhere).
            low = 0 if name == "max_logprobs" else 1
            if not low <= value <= MAX_INT32:
                raise ValueError(f"{name}={value} must be in [{low}, {MAX_INT32}]")


def check_size(num: int, limit: int, what: str, setting: str) -> None:
    """`num` items of `what` must not exceed `limit` (the `setting` that sets it)."""
    if num > limit:
        raise InvalidArgumentError(f"{what} is too large: {num}, more than the limit of {limit} ({setting})")


def check_text(text: str, limits: RequestLimits, field: str) -> None:
    """A client text must not be longer than max_prompt_chars."""
    check_size(len(text), limits.max_prompt_chars, f"{field} length in characters", "max_prompt_chars")


def check_texts(texts: Sequence[str], limits: RequestLimits, field: str) -> None:
    """A list of pooling inputs: their number and each one's length."""
    check_size(len(texts), limits.max_batch_inputs, f"number of {field}", "max_batch_inputs")
    for i, text in enumerate(texts):
        check_text(text, limits, f"{field}[{i}]")


def check_generate_sizes(request: GenerateInput, limits: RequestLimits) -> None:
    """Every size a generate request controls: prompt, messages, stop strings and ids."""
    if request.prompt_text is not None:
        check_text(request.prompt_text, limits, "prompt")
    if request.prompt_token_ids is not None:
        check_size(len(request.prompt_token_ids), limits.max_prompt_tokens, "prompt length in tokens",
                   "max_prompt_tokens")
    if request.messages is not None:
        check_size(len(request.messages), limits.max_messages, "number of messages", "max_messages")
        num_chars = sum(len(m.role) + len(m.content) for m in request.messages)
        check_size(num_chars, limits.max_prompt_chars, "messages length in characters", "max_prompt_chars")
    sampling = request.sampling
    check_size(len(sampling.stop), limits.max_stop_strings, "number of stop strings", "max_stop_strings")
    for i, stop in enumerate(sampling.stop):
        check_size(len(stop), limits.max_stop_string_chars, f"stop[{i}] length in characters",
                   "max_stop_string_chars")
    check_size(len(sampling.stop_token_ids), limits.max_stop_token_ids, "number of stop_token_ids",
               "max_stop_token_ids")


def effective_timeout_s(request_timeout_s: float, client_timeout_s: float | None) -> float | None:
    """A request's time budget: the smaller of the frontend's `request_timeout_s` (0: none) and the
    client's own deadline (a gRPC deadline; None: none). None: the request may run forever."""
    budgets = [t for t in (request_timeout_s or None, client_timeout_s) if t is not None]
    return max(min(budgets), 0.0) if budgets else None
