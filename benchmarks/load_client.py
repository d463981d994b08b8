"""An asyncio load client for any OpenAI-compatible /v1/completions endpoint, streamed over SSE.

Sends a workload at a fixed concurrency (a semaphore) and/or a request rate (Poisson arrivals),
and records TTFT, the gap between output chunks (ITL) and end-to-end latency per request. It
knows nothing about spindle: vLLM, llama.cpp and spindle are driven the same way. `run_load`
takes another sender for other endpoints (benchmarks/embed_bench.py sends /v1/embeddings).

    python -m benchmarks.load_client --base-url http://127.0.0.1:8000 --model NAME \
        --workload random --num-requests 128 --input-len 128 --output-len 128 --concurrency 64 --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import aiohttp
import numpy as np
from tqdm import tqdm

from benchmarks.metrics import LoadSummary, RequestResult, summarize
from benchmarks.workload import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_VOCAB_HIGH,
    FIRST_ORDINARY_TOKEN_ID,
    WORKLOADS,
    BenchRequest,
    WorkloadSpec,
    build_workload,
    completion_payload,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to send a workload.

    Attributes:
        base_url: server root (`http://host:port`) or its `/v1` URL.
        model: the model name the server expects in requests.
        concurrency: most requests in flight at once; None = no limit.
        request_rate: mean arrivals per second (Poisson); inf sends everything at once.
        seed: seeds the arrival times.
        timeout_s: limit for one request, start to end of stream.
        show_progress: draw a tqdm bar on stderr.
        fresh_connections: open a new connection per request instead of reusing idle ones. For
            servers that close kept-alive connections on their own schedule (llama.cpp's server
            did, so a reused one failed with "Server disconnected"); on loopback it costs ~0.1 ms
            a request, nothing beside a 128-token stream.
    """

    base_url: str
    model: str
    concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    timeout_s: float = 3600.0
    show_progress: bool = True
    fresh_connections: bool = False

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be at least 1 (or None for no limit)")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate} must be positive")

    def url(self, endpoint: str) -> str:
        """The URL of an OpenAI endpoint such as "completions" or "embeddings"."""
        root = self.base_url.rstrip("/")
        return f"{root}/{endpoint}" if root.endswith("/v1") else f"{root}/v1/{endpoint}"

    @property
    def completions_url(self) -> str:
        return self.url("completions")


@dataclass(frozen=True, slots=True)
class LoadRun:
    """Raw results in workload order, and their summary."""

    results: list[RequestResult]
    summary: LoadSummary


def _chunk_has_output(chunk: dict[str, object]) -> bool:
    """True if an SSE chunk carries generated text or token ids (not just usage or a finish reason)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    first = choices[0]
    return bool(first.get("text") or first.get("token_ids"))


def _cached_tokens(usage: dict[str, object]) -> int:
    """usage.prompt_tokens_details.cached_tokens (prefix-cache hits), 0 where a server omits it."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(cached) if isinstance(cached, int) else 0


async def send_request(session: aiohttp.ClientSession, config: LoadConfig, request: BenchRequest) -> RequestResult:
    """Send one streamed completion and time every output chunk; never raises for server faults."""
    result = RequestResult(prompt_len=request.prompt_len, expected_output_tokens=request.max_tokens)
    num_output_chunks = 0
    usage_tokens: int | None = None
    cached_tokens = 0
    start = last = time.perf_counter()
    try:
        async with session.post(config.completions_url, json=completion_payload(request, config.model)) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {body}"
                return result
            async for raw_line in resp.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    # vLLM-style in-stream error: the status was already 200.
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                if _chunk_has_output(chunk):
                    if num_output_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last = now
                    num_output_chunks += 1
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    cached_tokens = _cached_tokens(usage)
        result.e2e_s = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else num_output_chunks
        result.cached_prompt_tokens = cached_tokens
        if num_output_chunks == 0:
            result.error = "stream ended without any output chunk"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # ValueError covers bad JSON
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _arrivals(config: LoadConfig, n: int) -> AsyncIterator[int]:
    """Yield request indices, sleeping exponential gaps between them when a rate is set."""
    rng = np.random.default_rng(config.seed)
    for i in range(n):
        yield i
        if math.isfinite(config.request_rate) and i + 1 < n:
            await asyncio.sleep(float(rng.exponential(1.0 / config.request_rate)))


RequestT = TypeVar("RequestT")
# Sends one request and measures it; must not raise for server faults (record them in `error`).
Sender = Callable[[aiohttp.ClientSession, LoadConfig, RequestT], Awaitable[RequestResult]]


async def run_load(config: LoadConfig, requests: Sequence[RequestT],
                   send: Sender[RequestT] = send_request) -> LoadRun:  # type: ignore[assignment]
    """Send every request under the concurrency/rate limits and summarise; results keep workload order.

    `send` defaults to a streamed completion per BenchRequest; pass another for other endpoints.
    """
    if not requests:
        raise ValueError("requests is empty")
    semaphore = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    connector = aiohttp.TCPConnector(limit=config.concurrency or 0, force_close=config.fresh_connections)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    progress = tqdm(total=len(requests), disable=not config.show_progress, desc="requests", leave=False)

    async def one(session: aiohttp.ClientSession, request: RequestT) -> RequestResult:
        if semaphore is None:
            result = await send(session, config, request)
        else:
            async with semaphore:
                result = await send(session, config, request)
        progress.update(1)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        async for i in _arrivals(config, len(requests)):
            tasks.append(asyncio.create_task(one(session, requests[i])))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    progress.close()
    return LoadRun(results, summarize(results, duration))


async def run_with_warmup(config: LoadConfig, requests: Sequence[RequestT], warmup: Sequence[RequestT] = (),
                          send: Sender[RequestT] = send_request,  # type: ignore[assignment]
                          on_timed_start: Callable[[], None] | None = None) -> LoadRun:
    """Send `warmup` untimed (same concurrency, no bar), then time `requests`; `on_timed_start`
    is called between the two (e.g. to read counters that should cover only the timed part)."""
    if warmup:
        warm = await run_load(replace(config, request_rate=math.inf, show_progress=False), warmup, send)
        if warm.summary.num_failed:
            logger.warning("%d of %d warmup requests failed: %s", warm.summary.num_failed, len(warmup),
                           warm.summary.errors)
    if on_timed_start is not None:
        on_timed_start()
    return await run_load(config, requests, send)


def format_summary(summary: LoadSummary) -> str:
    """A human-readable block like vLLM's benchmark output."""
    s = summary
    lines = [
        f"requests: {s.num_completed} ok, {s.num_failed} failed, {s.num_length_mismatches} wrong length",
        f"duration: {s.duration_s:.2f} s",
        f"request throughput: {s.request_throughput:.2f} req/s",
        f"output throughput: {s.output_throughput:.1f} tok/s  (total {s.total_token_throughput:.1f} tok/s)",
    ]
    for name, stats in (("TTFT", s.ttft), ("ITL", s.itl), ("E2E", s.e2e)):
        lines.append(f"{name:5s} ms: mean {stats.mean_ms:.2f}  p50 {stats.p50_ms:.2f}  "
                     f"p90 {stats.p90_ms:.2f}  p99 {stats.p99_ms:.2f}")
    lines += [f"error: {e}" for e in s.errors]
    return "\n".join(lines) + "\n"


def warmup_spec(spec: WorkloadSpec, num_requests: int) -> WorkloadSpec:
    """Warmup requests: other prompts (so no prefix cache serves the timed ones), short outputs."""
    return replace(spec, num_requests=num_requests, seed=spec.seed + 1_000_003, output_len=min(spec.output_len, 8))


def config_to_dict(config: LoadConfig) -> dict[str, object]:
    """The config as strict JSON (an unlimited rate is null, not Infinity)."""
    out = asdict(config)
    out["request_rate"] = config.request_rate if math.isfinite(config.request_rate) else None
    return out


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_client", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name to put in requests")
    p.add_argument("--workload", default="random", choices=sorted(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (median for sharegpt-like)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (median for sharegpt-like)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by +/- this fraction")
    p.add_argument("--vocab-low", type=int, default=FIRST_ORDINARY_TOKEN_ID)
    p.add_argument("--vocab-high", type=int, default=DEFAULT_VOCAB_HIGH, help="model vocab size")
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    p.add_argument("--num-warmup", type=int, default=0, help="untimed requests sent first (other prompts)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=None, help="write summary and per-request results as JSON")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = WorkloadSpec(kind=args.workload, num_requests=args.num_requests, input_len=args.input_len,
                        output_len=args.output_len, range_ratio=args.range_ratio, vocab_low=args.vocab_low,
                        vocab_high=args.vocab_high, max_model_len=args.max_model_len, seed=args.seed)
    config = LoadConfig(base_url=args.base_url, model=args.model, concurrency=args.concurrency,
                        request_rate=args.request_rate, seed=args.seed, timeout_s=args.timeout,
                        show_progress=not args.no_progress)
    warmup = build_workload(warmup_spec(spec, args.num_warmup)) if args.num_warmup else []
    run = asyncio.run(run_with_warmup(config, build_workload(spec), warmup))
    sys.stdout.write(format_summary(run.summary))
    if args.out is not None:
        payload = {"config": config_to_dict(config), "workload": asdict(spec), "summary": run.summary.to_dict(),
                   "requests": [asdict(r) for r in run.results]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1, default=str))
        logger.info("wrote %s", args.out)
    if run.summary.num_completed == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
