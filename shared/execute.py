"""Messages between the scheduler and a worker, as dataclasses.

One `ExecuteRound` per scheduler decision (n forward passes), one `StepOutput` per forward
pass back. The worker keeps per-request state, so a round carries a request's tokens and
blocks once (`NewRequestData`) and afterwards only diffs (`CachedRequestData`).
Wire form: worker.proto, converted by `shared/execute_wire.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling import SamplingOptions
from shared.types import RequestKind


@dataclass(slots=True, frozen=True)
class MultiModalItem:
    """One image of a prompt: where its placeholder tokens sit and its preprocessed pixels.

    The placeholder range is [offset, offset + length) in the request's token ids; `length`
    is the number of feature tokens the encoder produces. `hash` names the content (equal
    images, equal hash), so the worker's encoder cache and the prefix cache can share it.
    """

    hash: str
    offset: int
    length: int
    pixel_values: bytes = b""  # float32, C-order, of `shape`
    shape: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen, or must recompute after a preemption."""

    request_id: str
    token_ids: list[int]  # prompt, then output generated before a preemption
    num_prompt_tokens: int
    num_computed_tokens: int  # KV already in the cache (prefix hit); computing starts here
    block_ids: list[int]
    sampling: SamplingOptions
    traceparent: str = ""
    mm_items: list[MultiModalItem] = field(default_factory=list)  # in prompt order


@dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the worker holds: blocks appended to each one's block table."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # one list per request


@dataclass(slots=True)
class PoolingRequestData:
    """A prefill-only request (embed or score): no KV cache, one pooled output."""

    request_id: str
    kind: RequestKind
    token_ids: list[int]
    token_type_ids: list[int] = field(default_factory=list)
    normalize: bool = False
    traceparent: str = ""


@dataclass(slots=True)
class ExecuteRound:
    """One scheduler decision for one worker: `num_steps` forward passes.

    Step 0 computes `num_scheduled_tokens[i]` tokens of each request, new requests first,
    then cached ones, in list order. A request whose step-0 tokens reach the end of its
    known tokens samples one token; in steps 1..num_steps-1 exactly those requests decode
    one more token each, their inputs fed from the previous step's samples on the device.
    The scheduler has already allocated blocks for all of those positions.
    """

    round_id: int
    num_steps: int = 1
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    pooling_requests: list[PoolingRequestData] = field(default_factory=list)
    # Encoder cache (multimodal): drop these outputs first, then encode these items (by
    # content hash) before step 0; the scheduler keeps the cache within its budget.
    encoder_free_hashes: list[str] = field(default_factory=list)
    encoder_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.cached_requests.request_ids or self.pooling_requests)


@dataclass(slots=True, frozen=True)
class AbortRows:
    """Requests the scheduler aborted while rounds carrying them may be in flight.

    Sent on the Execute stream between rounds but applied by the worker on arrival: the
    rows stop at the next step of the round computing and in the rounds queued behind it, so
    a client that disconnects stops costing compute within one step, not one round.
    """

    request_ids: list[str]


@dataclass(slots=True)
class StepOutput:
    """What one forward pass produced, in batch order."""

    round_id: int
    step_index: int
    request_ids: list[str] = field(default_factory=list)  # requests that sampled this step
    token_ids: list[int] = field(default_factory=list)
    # Logprob of each sampled token; empty unless some request in the batch asked.
    logprobs: list[float] = field(default_factory=list)
    # num_top_logprobs[i] entries of top_token_ids / top_logprobs belong to request_ids[i].
    num_top_logprobs: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    pooled: dict[str, list[float]] = field(default_factory=dict)
    is_last_step: bool = True
    sampled_unix_ns: int = 0  # wall time its tokens reached the worker's host (0: not recorded)


@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """What a worker serves and how much KV cache it holds."""

    model_id: str
    task: RequestKind
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    eos_token_ids: tuple[int, ...]
    attention_backend: str
    dtype: str
    device: str
    pooled_size: int = 0
    mm_tokens_per_item: int = 0  # feature tokens per image (0: the model takes no images)
    encoder_cache_tokens: int = 0  # encoder outputs the worker can hold, in feature tokens
    step_port: int = 0  # the worker's step socket (shared/step_frames.py); 0: Execute over gRPC only
    step_local_socket: str = ""  # the same on a local socket (shared/step_listener.py); "": none
