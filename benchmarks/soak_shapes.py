"""Random request shapes for the soak: protocol, prompt, sampling, how the client gives up, validity.

A shape is pure data, drawn from a seeded generator, so a failing soak can be replayed with the
same `--seed`. Valid shapes always fit the model's context (prompt plus max_tokens), so any
error they meet is the server's fault; invalid ones are each built to fail one specific check of
the frontend's validation (services/frontend/validation.py), so the only right answer is HTTP 400
or gRPC INVALID_ARGUMENT. Nothing here does I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from benchmarks.workload import FIRST_ORDINARY_TOKEN_ID, english_like_sentences

PROTOCOLS = ("grpc", "http-completion", "http-chat")
# Each breaks exactly one rule the frontend checks before the request reaches the scheduler.
INVALID_KINDS = ("temperature", "top_p", "max_tokens_zero", "token_id", "past_context", "empty_stop", "bad_json")
# Shared prompt prefixes, so some requests hit the prefix cache and share its blocks.
_NUM_PREFIXES = 4
# A text prompt's words: with the benchmark tokenizers a word is at most a few tokens, so this
# many words always fit the context with room for the output.
_MAX_TEXT_WORDS = 48


@dataclass(frozen=True, slots=True)
class Abort:
    """How a client gives up mid-request: after `after_chunks` streamed chunks, or `after_s` seconds
    (possibly before the first token); `disconnect` closes the connection (HTTP, or the gRPC
    channel) instead of cancelling the call on a shared channel."""

    after_chunks: int | None = None
    after_s: float | None = None
    disconnect: bool = False


@dataclass(frozen=True, slots=True)
class Shape:
    """One request to send.

    `prompt` is token ids or text (chat: the user message). `sampling` uses the OpenAI field
    names (max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, logprobs, ...);
    the gRPC sender maps them onto SamplingParams. `invalid` names the rule the request breaks.
    """

    protocol: str
    stream: bool
    prompt: list[int] | str
    sampling: dict[str, object] = field(default_factory=dict)
    system: str | None = None  # chat only
    abort: Abort | None = None
    invalid: str | None = None

    @property
    def max_tokens(self) -> int:
        return int(self.sampling["max_tokens"])  # type: ignore[call-overload]


@dataclass(frozen=True, slots=True)
class Mix:
    """Fractions of the traffic: of all requests, invalid and aborted ones; of valid HTTP
    requests, chat and non-streamed ones; of all requests, gRPC."""

    grpc: float = 0.5
    chat: float = 0.35
    non_stream: float = 0.2
    abort: float = 0.25
    invalid: float = 0.05

    def __post_init__(self) -> None:
        for name in ("grpc", "chat", "non_stream", "abort", "invalid"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be a fraction in [0, 1]")


class ShapeSource:
    """Draws shapes for a model with `vocab_size` tokens and room for `max_total_tokens` (prompt + output).

    Prompt lengths are log-uniform (many short, some long), outputs uniform up to `max_output`.
    """

    def __init__(self, seed: int, vocab_size: int, max_total_tokens: int, mix: Mix = Mix(),
                 max_prompt: int = 384, max_output: int = 160) -> None:
        if vocab_size <= FIRST_ORDINARY_TOKEN_ID + 1:
            raise ValueError(f"vocab_size={vocab_size} leaves no ordinary token ids")
        if max_total_tokens < 64:
            raise ValueError(f"max_total_tokens={max_total_tokens} is too small for a soak (at least 64)")
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.max_total = max_total_tokens
        self.mix = mix
        # Text prompts are at most _MAX_TEXT_WORDS words; keep a quarter of the context for them.
        self.max_prompt = min(max_prompt, max_total_tokens // 2)
        self.max_output = min(max_output, max_total_tokens // 4)
        self.words = " ".join(english_like_sentences(200, min_words=4, max_words=_MAX_TEXT_WORDS, seed=seed)).split()
        self.prefixes = [self._token_ids(self.rng.randint(32, self.max_prompt // 2)) for _ in range(_NUM_PREFIXES)]

    def next(self) -> Shape:
        rng = self.rng
        protocol = "grpc" if rng.random() < self.mix.grpc else (
            "http-chat" if rng.random() < self.mix.chat else "http-completion")
        stream = protocol == "grpc" or rng.random() >= self.mix.non_stream
        invalid = rng.choice(INVALID_KINDS) if rng.random() < self.mix.invalid else None
        if invalid == "bad_json" and protocol == "grpc":
            invalid = "token_id"  # a gRPC message that does not parse is the fuzz test's business
        shape = Shape(protocol=protocol, stream=stream, prompt=self._prompt(protocol), sampling=self._sampling(),
                      system=self._text(1, 12) if protocol == "http-chat" and rng.random() < 0.5 else None,
                      abort=self._abort(stream) if invalid is None and rng.random() < self.mix.abort else None)
        return _break(shape, invalid, self.vocab_size, self.max_total) if invalid else shape

    def _token_ids(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_ORDINARY_TOKEN_ID, self.vocab_size) for _ in range(n)]

    def _text(self, lo: int, hi: int) -> str:
        start = self.rng.randrange(len(self.words) - hi)
        return " ".join(self.words[start:start + self.rng.randint(lo, hi)])

    def _prompt(self, protocol: str) -> list[int] | str:
        rng = self.rng
        if protocol == "http-chat" or rng.random() < 0.3:
            return self._text(1, _MAX_TEXT_WORDS)
        length = max(1, int(round(self.max_prompt ** rng.random())))
        if rng.random() < 0.3:  # shared prefix, own suffix
            prefix = rng.choice(self.prefixes)
            return prefix + self._token_ids(max(1, length - len(prefix)))
        return self._token_ids(length)

    def _sampling(self) -> dict[str, object]:
        rng = self.rng
        sampling: dict[str, object] = {"max_tokens": rng.randint(1, self.max_output),
                                       "temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
        optional: dict[str, object] = {
            "top_p": rng.choice([0.5, 0.9, 1.0]), "top_k": rng.choice([-1, 0, 5, 50]),
            "min_p": rng.choice([0.0, 0.05]), "seed": rng.randrange(2**32),
            "repetition_penalty": rng.choice([1.0, 1.1]), "presence_penalty": rng.choice([-0.5, 0.0, 0.5]),
            "frequency_penalty": rng.choice([0.0, 0.3]), "ignore_eos": rng.random() < 0.5,
            "stop": [self._text(1, 1)[:rng.randint(1, 3)] for _ in range(rng.randint(1, 3))],
            "stop_token_ids": self._token_ids(rng.randint(1, 4)), "logprobs": rng.randint(0, 3),
            "min_tokens": rng.randint(0, 4),
        }
        for name, value in optional.items():
            if rng.random() < 0.25:
                sampling[name] = value
        if int(sampling.get("min_tokens", 0)) > int(sampling["max_tokens"]):  # type: ignore[call-overload]
            sampling["min_tokens"] = sampling["max_tokens"]
        return sampling

    def _abort(self, stream: bool) -> Abort:
        rng = self.rng
        disconnect = rng.random() < 0.5
        if stream and rng.random() < 0.6:
            return Abort(after_chunks=rng.randint(1, 24), disconnect=disconnect)
        return Abort(after_s=rng.uniform(0.0, 3.0), disconnect=disconnect)


def _break(shape: Shape, kind: str, vocab_size: int, max_total_tokens: int) -> Shape:
    """`shape` changed to break rule `kind` (one of INVALID_KINDS)."""
    sampling = dict(shape.sampling)
    prompt = shape.prompt
    if kind == "temperature":
        sampling["temperature"] = -1.0
    elif kind == "top_p":
        sampling["top_p"] = 1.5
    elif kind == "max_tokens_zero":
        sampling["max_tokens"] = 0
        sampling.pop("min_tokens", None)
    elif kind == "token_id":
        if shape.protocol == "http-chat":  # chat has no token-id prompt; a stop token id is checked the same way
            sampling["stop_token_ids"] = [vocab_size + 7]
        else:
            prompt = [FIRST_ORDINARY_TOKEN_ID, vocab_size + 7]
    elif kind == "past_context":
        sampling["max_tokens"] = max_total_tokens
        sampling.pop("min_tokens", None)
    elif kind == "empty_stop":
        sampling["stop"] = ["x", ""]
    elif kind != "bad_json":
        raise ValueError(f"unknown invalid kind {kind!r}; one of {INVALID_KINDS}")
    return Shape(protocol=shape.protocol, stream=shape.stream, prompt=prompt, sampling=sampling,
                 system=shape.system, abort=None, invalid=kind)
