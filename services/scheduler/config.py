"""`SchedulerConfig`: every knob of the scheduler service, built once in `__main__`.

Frozen and validated here; nothing below `__main__` reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.step_dial import STEP_TRANSPORTS
from shared.tls import TlsFiles

DEFAULT_LISTEN = "0.0.0.0:50052"
DEFAULT_WORKER_ADDRS = "127.0.0.1:50061"
# The smallest step-0 budget while requests decode: a few decoding streams still let a prompt
# through in a handful of chunks instead of a few tokens per step. 32, not 64, since the few-rows
# linear tiles made a decode step of 4-8 streams cheap (medium bf16, 8 streams: ~10 ms) beside a
# 64-token chunk (~40 ms): served, 24 requests of 128 + 128 tokens, two interleaved pairs
# (`python -m benchmarks.run --models medium --concurrency 4,8 --configs spindle --num-requests
# 24 --scheduler-steps 8 --spindle-arg=--dtype --spindle-arg=bfloat16`), ITL p99 / p50 at 4
# streams 3.41 / 3.85 -> 2.19 / 2.60, at 8 streams 4.41 / 4.03 -> 2.70 / 2.45, TTFT p50 at 8
# streams 423-482 -> 343-375 ms, output tok/s 501 / 574 -> 490 / 518 (4 streams 282 / 324 ->
# 307 / 345); the small model at 4-16 streams (48 requests) the same or better on each.
MIN_STEP_TOKENS_WHILE_DECODING = 32


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler settings (Helm `scheduler.*` values map 1:1 onto these).

    Attributes:
        listen: address the SchedulerService listens on.
        worker_addresses: one WorkerService per data-parallel worker.
        max_num_seqs: most requests holding KV blocks on one worker at once.
        max_num_batched_tokens: most tokens computed in step 0 of one round on one worker.
        num_scheduler_steps: decode steps per round when no prefill is pending (multi-step).
        round_target_ms: while the worker's steps are short, a decode round runs more steps than
            num_scheduler_steps (up to max_scheduler_steps), as many as take about this long
            (multi_step.round_steps; 0 = always num_scheduler_steps).
        max_scheduler_steps: the most steps a round grows to under round_target_ms.
        max_step_tokens_per_decode: while requests decode on a worker, step 0 of its round
            computes at most max(S x this, MIN_STEP_TOKENS_WHILE_DECODING) tokens, S the streams
            decoding or waiting there (at most max_num_seqs), so a burst of
            prefills stalls the streams already running for about this many decode steps at
            most (0 = off: max_num_batched_tokens alone). On a CPU a step's time grows with its
            tokens, so this bounds inter-token latency (round_builder.step_token_budget).
        enable_prefix_caching: share full computed KV blocks between requests by hash.
        enable_priority_preemption: a waiting request may preempt running lower-priority ones.
        max_inflight_rounds: rounds sent to a worker whose last step has not come back
            (2 = plan and send round k+1 while the worker runs round k).
        pipeline_quiet_rounds: a multi-step round is sent ahead only after this many rounds
            admitted no request (a round sent ahead delays arrivals by n steps; 0 = always).
        pipeline_lead_ms: before that, the next multi-step round is sent just in time: once the
            round in flight will end within this long, by the worker's measured step time
            (hides the scheduler round trip where steps are short; 0 = never).
        worker_ready_timeout_s: give up waiting for a worker's GetWorkerInfo after this long
            (0 waits forever).
        stats_interval_s: period of the INFO counters log while busy.
        max_waiting_requests: most requests waiting for admission (all workers together); past
            it a new request is refused with RESOURCE_EXHAUSTED.
        max_waiting_tokens: most tokens the waiting requests will prefill; past it a new request
            is refused with RESOURCE_EXHAUSTED (an empty queue takes any request).
        limit_mm_per_prompt: most images in one request (vision-language models); it also sizes
            the encoder-cache budget (encoder_budget.py), so the frontend enforces it too.
        metrics_port: port of the Prometheus /metrics endpoint (None: off; 0: a free port).
        internal_tls: mutual TLS for the SchedulerService and the channels to the workers; None: plaintext.
        step_transport: "socket": a worker's Execute stream runs on its step socket where it offers one
            (shared/step_frames.py; never with internal_tls); "grpc": always on gRPC's Execute.
        step_port: port of the scheduler's own step socket, where frontends run their Connect
            stream without gRPC, on the listen host; 0: a free one, -1: none (Connect on gRPC only).
            With internal_tls there is none.
        max_worker_failures: a request that was on this many failing workers fails alone (it may
            be what makes them fail); others move to live workers.
        state_store: where accepted requests are journaled: "memory" or a redis:// URL.
        orphan_timeout_s: after a restart, journaled requests wait this long for their frontend
            to re-submit them, then are dropped.
        shutdown_grace_s: on SIGTERM new requests are refused and running ones get this long to
            finish; what is left stays journaled for the next scheduler.
    """

    listen: str = DEFAULT_LISTEN
    worker_addresses: tuple[str, ...] = (DEFAULT_WORKER_ADDRS,)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_scheduler_steps: int = 8
    round_target_ms: float = 24.0
    max_scheduler_steps: int = 32
    max_step_tokens_per_decode: int = 3
    enable_prefix_caching: bool = True
    enable_priority_preemption: bool = False
    max_inflight_rounds: int = 2
    pipeline_quiet_rounds: int = 2
    pipeline_lead_ms: float = 5.0
    worker_ready_timeout_s: float = 0.0
    stats_interval_s: float = 10.0
    max_waiting_requests: int = 4096
    max_waiting_tokens: int = 2**21
    limit_mm_per_prompt: int = 4
    metrics_port: int | None = None
    internal_tls: TlsFiles | None = None
    step_transport: str = "socket"
    step_port: int = 0
    max_worker_failures: int = 3
    state_store: str = "memory"
    orphan_timeout_s: float = 60.0
    shutdown_grace_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.worker_addresses:
            raise ValueError(f"{self.worker_addresses=} must name at least one worker")
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps", "max_scheduler_steps",
                     "max_inflight_rounds", "max_waiting_requests", "max_waiting_tokens",
                     "limit_mm_per_prompt"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.max_step_tokens_per_decode != 0 and self.max_step_tokens_per_decode < 2:
            raise ValueError(f"{self.max_step_tokens_per_decode=} must be 0 (off) or >= 2 (room for prefills)")
        if self.pipeline_quiet_rounds < 0:
            raise ValueError(f"{self.pipeline_quiet_rounds=} must be >= 0")
        if self.pipeline_lead_ms < 0:
            raise ValueError(f"{self.pipeline_lead_ms=} must be >= 0")
        if self.round_target_ms < 0:
            raise ValueError(f"{self.round_target_ms=} must be >= 0")
        if self.worker_ready_timeout_s < 0:
            raise ValueError(f"{self.worker_ready_timeout_s=} must be >= 0")
        if self.stats_interval_s <= 0:
            raise ValueError(f"{self.stats_interval_s=} must be > 0")
        if self.max_worker_failures < 1:
            raise ValueError(f"{self.max_worker_failures=} must be >= 1")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"{self.shutdown_grace_s=} must be >= 0")
        if self.orphan_timeout_s <= 0:
            raise ValueError(f"{self.orphan_timeout_s=} must be > 0")
        if self.step_transport not in STEP_TRANSPORTS:
            raise ValueError(f"{self.step_transport=} must be one of {STEP_TRANSPORTS}")
        if not -1 <= self.step_port <= 65535:
            raise ValueError(f"{self.step_port=} must be a TCP port, 0 (a free one) or -1 (none)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"{self.metrics_port=} is not a TCP port")
