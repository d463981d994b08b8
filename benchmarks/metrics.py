"""Per-request measurements and their summary (throughput, TTFT/ITL/E2E percentiles).

Pure arithmetic over recorded times: no I/O, so the same summary serves the HTTP load client
and the in-process limit loop, and is unit-testable with made-up numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(slots=True)
class RequestResult:
    """What one request measured. Times are seconds from `time.perf_counter()`.

    Attributes:
        prompt_len: prompt tokens sent.
        expected_output_tokens: max_tokens asked for (exact with ignore_eos).
        output_tokens: tokens generated: usage.completion_tokens if the server sent usage, else
            the number of chunks that carried output.
        ttft_s: first output chunk minus send time.
        itls_s: gaps between consecutive output chunks (one per chunk after the first).
        e2e_s: end of stream minus send time.
        error: why the request failed; None on success.
        cached_prompt_tokens: prompt tokens the server served from its prefix cache
            (usage.prompt_tokens_details.cached_tokens; 0 if it does not say).
    """

    prompt_len: int
    expected_output_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None
    cached_prompt_tokens: int = 0

    @property
    def is_success(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of one latency series, in milliseconds."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_s: Sequence[float]) -> LatencyStats:
        """Mean and percentiles (numpy's linear interpolation) of seconds, reported in ms; zeros if empty."""
        if not values_s:
            return cls(0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """A benchmark run reduced to the figures the report prints.

    Throughputs count successful requests only and divide by `duration_s`, the wall time from
    the first send to the last completion.
    """

    num_requests: int
    num_completed: int
    num_failed: int
    num_length_mismatches: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    errors: tuple[str, ...] = ()
    total_cached_prompt_tokens: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(results: Sequence[RequestResult], duration_s: float) -> LoadSummary:
    """Reduce per-request results measured over `duration_s` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be positive")
    ok = [r for r in results if r.is_success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    # Distinct error texts, first few only: a dead server fails every request the same way.
    errors = tuple(dict.fromkeys(r.error for r in results if r.error is not None))[:5]
    return LoadSummary(
        num_requests=len(results),
        num_completed=len(ok),
        num_failed=len(results) - len(ok),
        num_length_mismatches=sum(r.output_tokens != r.expected_output_tokens for r in ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft=LatencyStats.of([r.ttft_s for r in ok]),
        itl=LatencyStats.of([gap for r in ok for gap in r.itls_s]),
        e2e=LatencyStats.of([r.e2e_s for r in ok]),
        errors=errors,
        total_cached_prompt_tokens=sum(r.cached_prompt_tokens for r in ok),
    )


def steady_state_itls(results: Sequence[RequestResult], min_decoding: float = 0.9) -> list[float]:
    """The output gaps measured while the batch decoded: after the last first token, while at least
    `min_decoding` of the requests had not yet ended.

    For a batch sent all at once (the context sweep sends exactly as many requests as streams), a
    gap inside that window is one decode step with no prefill mixed in (every request already had
    its first token) and nearly the whole batch in it, the step time the sweep reports. Nearly, not
    all: a server whose frontend takes a while to take in a burst of long prompts may run the first
    request it took to its end before the last one starts (spindle on 2 cores, 64 prompts of 4,096
    tokens: in half the runs), which left no window with every request decoding; a few such
    requests, 10 % by default, move the window's end instead of emptying it. Times are taken from
    each request's own send, which the window assumes were simultaneous. Empty when more than that
    share ended before the last one started decoding, or when nothing succeeded.
    """
    if not 0.0 <= min_decoding <= 1.0:
        raise ValueError(f"min_decoding={min_decoding} must be a share in [0, 1]")
    ok = [r for r in results if r.is_success]
    if not ok:
        return []
    start = max(r.ttft_s for r in ok)
    may_end = min(math.floor(len(ok) * (1.0 - min_decoding) + 1e-9), len(ok) - 1)  # how many may have ended
    end = sorted(r.e2e_s for r in ok)[may_end]
    gaps: list[float] = []
    for r in ok:
        t = r.ttft_s
        for gap in r.itls_s:
            t += gap
            if start < t <= end:
                gaps.append(gap)
    return gaps
