"""Request validation: every check a request must pass before it reaches the scheduler.

Cheap checks on the sampling fields run before tokenization (fail fast); length checks run
after it. Every failure is a typed error naming the field and the offending value. Defaults
for unset fields: temperature, top_p, top_k, min_p and repetition_penalty from the model's
generation_config.json (else 1.0, 1.0, off, off, 1.0); presence/frequency penalty 0;
min_tokens 0; max_tokens `default_max_tokens` capped to what fits after the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.frontend.generation_defaults import GenerationDefaults
from services.frontend.messages import SamplingRequest, SchedulerInfo
from shared.errors import InvalidArgumentError, NotFoundError
from shared.sampling import SamplingOptions

MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1
MAX_INT32 = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Range:
    """An allowed interval; `lo_open`/`hi_open` exclude the bound. NaN is never inside."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, value: float) -> bool:
        if math.isnan(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        hi = "inf" if math.isinf(self.hi) else f"{self.hi:g}"
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {hi}{')' if self.hi_open else ']'}"


# The allowed range of each numeric sampling field (None values are skipped).
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    # -1 is accepted as "off" for vLLM-style clients; 0 also means off.
    "top_k": Range(-1, MAX_INT32),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, 100.0, lo_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "max_tokens": Range(1, MAX_INT32),
    "min_tokens": Range(0, MAX_INT32),
    "logprobs": Range(0, MAX_LOGPROBS),
    "seed": Range(0, MAX_SEED),
}


def check_model(requested: str, served_model_name: str) -> None:
    """An empty name selects the served model; any other name must match it."""
    if requested and requested != served_model_name:
        raise NotFoundError(f"model {requested!r} does not exist; this server serves {served_model_name!r}")


def check_sampling(sampling: SamplingRequest, vocab_size: int) -> None:
    """Range checks that need no tokenization (run first, so bad requests fail fast)."""
    for name, allowed in SAMPLING_RANGES.items():
        value = getattr(sampling, name)
        if value is not None and not allowed.contains(value):
            raise InvalidArgumentError(f"{name}={value} is out of range: must be in {allowed}")
    if (sampling.min_tokens is not None and sampling.max_tokens is not None
            and sampling.min_tokens > sampling.max_tokens):
        raise InvalidArgumentError(
            f"min_tokens={sampling.min_tokens} must not exceed max_tokens={sampling.max_tokens}"
        )
    for i, stop in enumerate(sampling.stop):
        if not stop:
            raise InvalidArgumentError(f"stop[{i}] is an empty string; stop strings must not be empty")
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Every id must be in [0, vocab_size)."""
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgumentError(
                f"{field}[{i}]={token_id} is not a valid token id: must be in [0, {vocab_size})"
            )


def check_prompt(prompt_token_ids: Sequence[int], info: SchedulerInfo) -> None:
    """The prompt must be non-empty, made of valid ids, and leave room for one output token."""
    if not prompt_token_ids:
        raise InvalidArgumentError("prompt is empty: it must contain at least one token")
    check_token_ids(prompt_token_ids, info.vocab_size, "prompt")
    limit = info.max_total_tokens
    if len(prompt_token_ids) >= limit:
        raise InvalidArgumentError(
            f"prompt is too long: {len(prompt_token_ids)} tokens, but the model's context length is "
            f"{limit} tokens (prompt plus output)"
        )


def resolve_sampling(sampling: SamplingRequest, num_prompt_tokens: int, info: SchedulerInfo,
                     defaults: GenerationDefaults, default_max_tokens: int) -> SamplingOptions:
    """Fill every default and check prompt + max_tokens against the context length.

    Call after `check_sampling` and `check_prompt`. An unset max_tokens is clamped to what
    fits; an explicit one that does not fit is an error (the client asked for the impossible).
    """
    room = info.max_total_tokens - num_prompt_tokens
    if sampling.max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    elif sampling.max_tokens > room:
        raise InvalidArgumentError(
            f"max_tokens={sampling.max_tokens} is too large: the prompt has {num_prompt_tokens} tokens and "
            f"the model's context length is {info.max_total_tokens}, so at most {room} tokens can be generated"
        )
    else:
        max_tokens = sampling.max_tokens
    min_tokens = min(sampling.min_tokens or 0, max_tokens)
    top_k = sampling.top_k if sampling.top_k is not None else defaults.top_k
    return SamplingOptions(
        temperature=_pick(sampling.temperature, defaults.temperature),
        top_k=max(top_k, 0),
        top_p=_pick(sampling.top_p, defaults.top_p),
        min_p=_pick(sampling.min_p, defaults.min_p),
        seed=sampling.seed,
        repetition_penalty=_pick(sampling.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_pick(sampling.presence_penalty, 0.0),
        frequency_penalty=_pick(sampling.frequency_penalty, 0.0),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
    )


def _pick(value: float | None, default: float) -> float:
    return float(default if value is None else value)
