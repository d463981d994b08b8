"""Request validation: every check a request must pass before it reaches the scheduler.

Cheap checks on the sampling fields run before tokenization (fail fast); length checks run
after it. Every failure is a typed error naming the field and the offending value. Every
number a client sends is checked against the range of the wire type that carries it to the
scheduler (int32, uint64), so no request can fail the serialisation of a batch it shares
with others; the configured size limits are limits.py's. Defaults
for unset fields: temperature, top_p, top_k, min_p and repetition_penalty from the model's
generation_config.json (else 1.0, 1.0, off, off, 1.0); presence/frequency penalty 0;
min_tokens 0; max_tokens `default_max_tokens` capped to what fits after the prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.frontend.generation_defaults import GenerationDefaults
from services.frontend.messages import SamplingRequest, SchedulerInfo
from shared.errors import InvalidArgumentError, NotFoundError
from shared.sampling import SamplingOptions

if TYPE_CHECKING:
    from services.frontend.limits import RequestLimits

MAX_SEED = 2**64 - 1  # uint64
MIN_INT32 = -(2**31)
MAX_INT32 = 2**31 - 1
MAX_REQUEST_ID_CHARS = 256
# Most choices (n, best_of) per request: each is a sequence of its own in the batch.
MAX_SAMPLES = 128
# Most logit_bias entries per request (each is a scatter on every step's logits).
MAX_LOGIT_BIAS_ENTRIES = 1024
_QUOTE_CHARS = 64


@dataclass(frozen=True, slots=True)
class Range:
    """An allowed interval; `lo_open`/`hi_open` exclude the bound. NaN is never inside.

    Integer bounds stay ints, so comparisons with integer values are exact (2**64 is not
    inside [0, 2**64 - 1], though both round to the same float). `setting` names the
    configuration that sets the bound, for the error message.
    """

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    setting: str = ""

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):  # (math.isnan overflows on a huge int)
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        interval = f"{'(' if self.lo_open else '['}{_bound(self.lo)}, {_bound(self.hi)}{')' if self.hi_open else ']'}"
        return f"{interval} ({self.setting})" if self.setting else interval

    def check(self, value: float | None, field: str) -> None:
        """Raise naming `field` unless `value` is None or inside."""
        if value is not None and not self.contains(value):
            raise InvalidArgumentError(f"{field}={show_number(value)} is out of range: must be in {self}")


def _bound(value: float) -> str:
    return str(value) if isinstance(value, int) else "inf" if math.isinf(value) else f"{value:g}"


def show_number(value: float) -> str:
    """A client's number for an error message; a huge JSON integer stays short (and never meets float())."""
    if not isinstance(value, int) or abs(value) < 10**30:
        return str(value)
    digits = str(abs(value))
    return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"


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
    "min_tokens": Range(0, MAX_INT32),
    "seed": Range(0, MAX_SEED),
}
INT32 = Range(MIN_INT32, MAX_INT32)
LOGIT_BIAS = Range(-100.0, 100.0)


def quote(text: str) -> str:
    """A client's string for an error message: repr'd (so any character is safe), cut short."""
    return repr(text) if len(text) <= _QUOTE_CHARS else f"{text[:_QUOTE_CHARS]!r}... ({len(text)} characters)"


def check_request_id(request_id: str) -> None:
    """A client-chosen id travels in logs, traces and every message about the request: keep it plain."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgumentError(f"request_id is too long: {len(request_id)} characters, more than the limit of "
                                   f"{MAX_REQUEST_ID_CHARS}")
    if not (request_id.isascii() and request_id.isprintable()):
        raise InvalidArgumentError(f"request_id={quote(request_id)} must be printable ASCII")


def check_model(requested: str, served_model_name: str) -> None:
    """An empty name selects the served model; any other name must match it."""
    if requested and requested != served_model_name:
        raise NotFoundError(f"model {quote(requested)} does not exist; this server serves {served_model_name!r}")


def check_sampling(sampling: SamplingRequest, vocab_size: int, limits: RequestLimits) -> None:
    """Range checks that need no tokenization (run first, so bad requests fail fast)."""
    for name, allowed in SAMPLING_RANGES.items():
        allowed.check(getattr(sampling, name), name)
    Range(1, limits.max_output_tokens, setting="max_output_tokens").check(sampling.max_tokens, "max_tokens")
    Range(0, limits.max_logprobs, setting="max_logprobs").check(sampling.logprobs, "logprobs")
    if (sampling.min_tokens is not None and sampling.max_tokens is not None
            and sampling.min_tokens > sampling.max_tokens):
        raise InvalidArgumentError(
            f"min_tokens={sampling.min_tokens} must not exceed max_tokens={sampling.max_tokens}"
        )
    if sampling.grammar is not None:
        check_grammar_options(sampling)
    for i, stop in enumerate(sampling.stop):
        if not stop:
            raise InvalidArgumentError(f"stop[{i}] is an empty string; stop strings must not be empty")
    check_token_ids(sampling.stop_token_ids, vocab_size, "stop_token_ids")
    check_logit_bias(sampling.logit_bias, vocab_size)


def check_grammar_options(sampling: SamplingRequest) -> None:
    """Structured output ends with EOS once the grammar is complete: options that forbid it conflict."""
    if sampling.ignore_eos:
        raise InvalidArgumentError("ignore_eos cannot be combined with structured output (response_format or a "
                                   "grammar): the request ends with EOS when its grammar is complete")
    if sampling.min_tokens:
        raise InvalidArgumentError("min_tokens cannot be combined with structured output (response_format or a "
                                   "grammar): the grammar alone decides when the output is complete")


def check_logit_bias(logit_bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
    """Each entry a token id of the vocabulary, with a bias in [-100, 100] (OpenAI's range)."""
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgumentError(f"logit_bias has {len(logit_bias)} entries, more than the limit of "
                                   f"{MAX_LOGIT_BIAS_ENTRIES}")
    seen: set[int] = set()
    for token_id, bias in logit_bias:
        if not 0 <= token_id < vocab_size:
            raise InvalidArgumentError(f"logit_bias: {show_number(token_id)} is not a valid token id: must be in "
                                       f"[0, {vocab_size})")
        if token_id in seen:
            raise InvalidArgumentError(f"logit_bias: token id {token_id} is given twice")
        seen.add(token_id)
        LOGIT_BIAS.check(bias, f"logit_bias[{token_id}]")


def check_samples(n: int, best_of: int | None) -> None:
    """n choices out of best_of candidates (best_of >= n), each at most MAX_SAMPLES."""
    Range(1, MAX_SAMPLES).check(n, "n")
    if best_of is not None:
        Range(1, MAX_SAMPLES).check(best_of, "best_of")
        if best_of < n:
            raise InvalidArgumentError(f"best_of={best_of} must be at least n={n}: it is the number of candidates "
                                       "the n choices are picked from")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Every id must be in [0, vocab_size)."""
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgumentError(
                f"{field}[{i}]={show_number(token_id)} is not a valid token id: must be in [0, {vocab_size})"
            )


def check_prompt(prompt_token_ids: Sequence[int], info: SchedulerInfo, max_prompt_tokens: int) -> None:
    """The prompt must be non-empty, made of valid ids, and leave room for one output token."""
    if not prompt_token_ids:
        raise InvalidArgumentError("prompt is empty: it must contain at least one token")
    if len(prompt_token_ids) > max_prompt_tokens:
        raise InvalidArgumentError(f"prompt is too long: {len(prompt_token_ids)} tokens, more than the limit of "
                                   f"{max_prompt_tokens} (max_prompt_tokens)")
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
        logit_bias=tuple(sorted(sampling.logit_bias)),
        grammar=sampling.grammar,
    )


def _pick(value: float | None, default: float) -> float:
    return float(default if value is None else value)
