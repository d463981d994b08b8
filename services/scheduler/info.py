"""`SchedulerInfo` and `SchedulerStats`: what GetSchedulerInfo reports (scheduler.proto mirrors)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.types import RequestKind


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    """Cumulative counters since start, and current queue sizes."""

    num_steps: int = 0  # forward steps whose output came back
    num_rounds: int = 0
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    num_prefix_hit_tokens: int = 0  # ... and found there
    num_running: int = 0
    num_waiting: int = 0  # including preempted ones
    num_finished: int = 0  # stopped by a stop token, a length limit or pooling
    num_aborted: int = 0
    num_failed: int = 0  # rejected or failed with an error
    num_free_blocks: int = 0
    num_kv_blocks: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        queries = self.num_prefix_query_tokens
        return self.num_prefix_hit_tokens / queries if queries else 0.0


@dataclass(slots=True, frozen=True)
class SchedulerInfo:
    """The served model and the scheduler's limits; `ready` once every worker answered."""

    ready: bool
    model_id: str = ""
    task: RequestKind = RequestKind.GENERATE
    max_model_len: int = 0
    vocab_size: int = 0
    num_workers: int = 0
    num_kv_blocks: int = 0  # over all workers
    block_size: int = 0
    max_request_tokens: int = 0  # longest prompt + output one worker's KV pool can hold
    stats: SchedulerStats = SchedulerStats()
    mm_tokens_per_item: int = 0  # feature tokens per image; 0: the model takes no images
    limit_mm_per_prompt: int = 0
