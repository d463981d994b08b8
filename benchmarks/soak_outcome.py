"""`Outcome`: what one soak request came to, the rules that judge a server's answer, and `Tally`.

A valid request that the client did not abort must end with a normal finish reason (stop or
length, and length means exactly max_tokens tokens); an invalid one must be refused with HTTP
400 / gRPC INVALID_ARGUMENT before any token; an aborted one must not have failed before the
client gave up. Anything else is an ERROR with a short reason, which fails the soak. Both
protocol senders (soak_http, soak_grpc) judge through these functions, so the rules are one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from benchmarks.soak_shapes import Shape

COMPLETED, ABORTED, REJECTED, ERROR = "completed", "aborted", "rejected", "error"
KINDS = (COMPLETED, ABORTED, REJECTED, ERROR)
NORMAL_FINISH = ("stop", "length")


@dataclass(frozen=True, slots=True)
class Outcome:
    """`kind` is one of KINDS; `tokens` the output tokens the client received; `detail` the reason
    of an ERROR (the finish reason or refusal code otherwise)."""

    kind: str
    protocol: str
    tokens: int = 0
    detail: str = ""


def judge_finish(shape: Shape, finish: str | None, num_tokens: int) -> Outcome:
    """The outcome of a request the server ended (the client did not give up)."""
    if shape.invalid is not None:
        return Outcome(ERROR, shape.protocol, num_tokens, f"invalid ({shape.invalid}) request was accepted")
    if finish not in NORMAL_FINISH:
        return Outcome(ERROR, shape.protocol, num_tokens, f"finish reason {finish!r}")
    if finish == "length" and num_tokens != shape.max_tokens:
        return Outcome(ERROR, shape.protocol, num_tokens,
                       f"finish reason length after {num_tokens} tokens, max_tokens={shape.max_tokens}")
    return Outcome(COMPLETED, shape.protocol, num_tokens, finish)


def judge_refusal(shape: Shape, code: str, message: str) -> Outcome:
    """The outcome of a request refused with HTTP status or gRPC code `code` before any token."""
    expected = "INVALID_ARGUMENT" if shape.protocol == "grpc" else "400"
    if shape.invalid is not None and code == expected:
        return Outcome(REJECTED, shape.protocol, 0, code)
    what = f"invalid ({shape.invalid})" if shape.invalid else "valid"
    return Outcome(ERROR, shape.protocol, 0, f"{what} request refused with {code}: {message[:160]}")


def judge_failure(shape: Shape, num_tokens: int, reason: str) -> Outcome:
    """A transport failure, or a stream the server broke off after it had started."""
    return Outcome(ERROR, shape.protocol, num_tokens, reason[:200])


class AbortTimer:
    """The client's own give-up timer (`after_s`; None: never), told apart from any other timeout."""

    def __init__(self, after_s: float | None) -> None:
        self.scope = asyncio.timeout(after_s)

    def fired(self) -> bool:
        return self.scope.expired()


@dataclass
class Tally:
    """Outcomes counted by kind and protocol, output tokens, and the first few errors in full."""

    kinds: Counter[str] = field(default_factory=Counter)
    by_protocol: Counter[tuple[str, str]] = field(default_factory=Counter)
    error_reasons: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    examples: list[str] = field(default_factory=list)
    max_examples: int = 20

    def add(self, outcome: Outcome) -> None:
        self.kinds[outcome.kind] += 1
        self.by_protocol[(outcome.protocol, outcome.kind)] += 1
        self.tokens += outcome.tokens
        if outcome.kind == ERROR:
            # Numbers vary between requests; the reason without them groups alike errors.
            self.error_reasons[_without_digits(outcome.detail)[:80]] += 1
            if len(self.examples) < self.max_examples:
                self.examples.append(f"{outcome.protocol}: {outcome.detail}")

    @property
    def total(self) -> int:
        return sum(self.kinds.values())


def _without_digits(text: str) -> str:
    return "".join("#" if c.isdigit() else c for c in text)
