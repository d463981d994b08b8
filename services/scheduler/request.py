"""`Request`: the scheduler's record of one accepted request, serialisable for a journal.

Owns a request's tokens, counters and status; it never decides policy (scheduler.py) and
never touches KV blocks (kv_block_manager.py holds the block tables).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from shared.execute import MultiModalItem
from shared.grammar import Grammar, GrammarKind
from shared.sampling import SamplingOptions
from shared.types import RequestKind, StopReason


class RequestStatus(enum.Enum):
    """Where a request is in its life.

    WAITING: queued, never run (or replayed from a journal); holds no blocks.
    RUNNING: in its worker's running set; holds blocks; the worker knows it.
    PREEMPTED: blocks freed; waits to be re-added with prompt + generated tokens.
    FINISHED: stopped, aborted or failed; nothing refers to it any more.
    """

    WAITING = "WAITING"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    FINISHED = "FINISHED"


# Fields written by `to_dict`: the durable state. Everything else is transient bookkeeping
# about rounds in flight, rebuilt as zero when a journal is replayed (the request then
# restarts from prompt + output tokens, exactly like a preempted one).
_DURABLE_FIELDS = (
    "request_id", "kind", "prompt_token_ids", "output_token_ids", "sampling", "priority",
    "arrival_seq", "status", "num_computed_tokens", "num_cached_tokens", "worker_index",
    "connection_id", "traceparent", "deadline_unix_s", "cache_salts", "token_type_ids",
    "num_preemptions", "stop_reason", "mm_items", "frontend_id", "normalize",
)


@dataclass(slots=True, eq=False)
class Request:
    """One request as the scheduler sees it.

    Counters (NOTE: with pipelining the scheduler runs ahead of the worker):
        num_computed_tokens: KV positions computed once every round sent so far has run
            (optimistic). Reset to 0 (or the prefix hit) when the request is (re)admitted.
        num_inflight_tokens: tokens that rounds already sent will still sample for it.
        num_optimistic_tokens: len(all_token_ids) + num_inflight_tokens, the token count
            the worker will know after the rounds in flight.
        num_inflight_rounds: rounds sent that include it and whose last step has not come
            back; a preempted request is re-admitted only when this is 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    kind: RequestKind = RequestKind.GENERATE
    priority: int = 0  # larger runs earlier
    arrival_seq: int = 0  # FCFS order within a priority, set by the scheduler
    connection_id: int = 0  # the frontend stream that owns it
    frontend_id: str = ""  # the frontend process that owns it (outlives a scheduler restart)
    traceparent: str = ""
    deadline_unix_s: float = 0.0  # 0 means none
    cache_salts: tuple[str, ...] = ()  # extra prefix-cache keys of the whole chain (salts)
    mm_items: tuple[MultiModalItem, ...] = ()  # images, sorted by offset, ranges disjoint
    token_type_ids: list[int] = field(default_factory=list)  # cross-encoder segments
    normalize: bool = False  # embed requests: the worker L2-normalises the vector
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    worker_index: int | None = None
    num_preemptions: int = 0
    stop_reason: StopReason | None = None
    # Not journaled: a frontend re-submitting after a restart sends it again.
    shares_prompt_with: str = ""  # a later sample of an n > 1 request: the id of the group's first
    # ---- transient (not journaled) ----
    all_token_ids: list[int] = field(init=False, default_factory=list)
    block_hashes: list[bytes] = field(init=False, default_factory=list)  # full blocks, chained
    num_inflight_tokens: int = field(init=False, default=0)
    num_inflight_rounds: int = field(init=False, default=0)
    is_on_worker: bool = field(init=False, default=False)  # the worker holds state for it
    span_traceparent: str = field(init=False, default="")  # the scheduler's span for it, when tracing
    is_resumed: bool = field(init=False, default=False)  # re-submitted by its frontend after a reconnect
    num_worker_failures: int = field(init=False, default=0)  # workers that died or failed a round under it

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    # ---- token bookkeeping ----

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_optimistic_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_inflight_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_generate(self) -> bool:
        return self.kind is RequestKind.GENERATE

    def reset_for_recompute(self) -> None:
        """Its worker is gone: it holds nothing anywhere and will recompute prompt + output."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_inflight_tokens = 0
        self.num_inflight_rounds = 0
        self.is_on_worker = False
        self.worker_index = None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def max_total_tokens(self, max_model_len: int) -> int:
        """The most tokens (prompt + output) this request can ever hold."""
        if not self.is_generate:
            return self.num_prompt_tokens
        return min(self.num_prompt_tokens + self.sampling.max_tokens, max_model_len)

    # ---- journal ----

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (str/int/float/bool/list/dict/None only) of the durable state."""
        out: dict[str, Any] = {}
        for name in _DURABLE_FIELDS:
            value = getattr(self, name)
            if name == "sampling":
                value = dataclasses.asdict(value)
                value["stop_token_ids"] = list(value["stop_token_ids"])
                value["logit_bias"] = [list(pair) for pair in value["logit_bias"]]
                if value["grammar"] is not None:
                    value["grammar"] = {"kind": value["grammar"]["kind"].value, "spec": value["grammar"]["spec"]}
            elif name in ("kind", "stop_reason"):
                value = None if value is None else int(value)
            elif name == "status":
                value = value.value
            elif name == "mm_items":
                value = [_item_to_dict(item) for item in value]
            elif isinstance(value, (list, tuple)):
                value = list(value)
            out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Request:
        """Inverse of `to_dict`; transient in-flight counters start at zero.

        Values are restored verbatim: a journal replaying a request into a fresh scheduler
        resets it to WAITING with num_computed_tokens 0 (it then recomputes prompt + output,
        as after a preemption).
        """
        sampling = dict(data["sampling"])
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
        sampling["logit_bias"] = tuple((int(t), float(b)) for t, b in sampling.get("logit_bias", ()))
        grammar = sampling.get("grammar")
        sampling["grammar"] = Grammar(GrammarKind(grammar["kind"]), grammar["spec"]) if grammar else None
        stop_reason = data.get("stop_reason")
        return cls(
            request_id=data["request_id"],
            prompt_token_ids=list(data["prompt_token_ids"]),
            sampling=SamplingOptions(**sampling),
            kind=RequestKind(data["kind"]),
            priority=data["priority"],
            arrival_seq=data["arrival_seq"],
            connection_id=data["connection_id"],
            frontend_id=data.get("frontend_id", ""),
            traceparent=data["traceparent"],
            deadline_unix_s=data["deadline_unix_s"],
            cache_salts=tuple(data["cache_salts"]),
            mm_items=tuple(_item_from_dict(item) for item in data.get("mm_items", ())),
            token_type_ids=list(data["token_type_ids"]),
            normalize=data.get("normalize", False),
            output_token_ids=list(data["output_token_ids"]),
            status=RequestStatus(data["status"]),
            num_computed_tokens=data["num_computed_tokens"],
            num_cached_tokens=data["num_cached_tokens"],
            worker_index=data["worker_index"],
            num_preemptions=data["num_preemptions"],
            stop_reason=None if stop_reason is None else StopReason(stop_reason),
        )


def _item_to_dict(item: MultiModalItem) -> dict[str, Any]:
    """Plain data for the journal (pixels as base64 text)."""
    return {"hash": item.hash, "offset": item.offset, "length": item.length,
            "pixel_values": base64.b64encode(item.pixel_values).decode(), "shape": list(item.shape)}


def _item_from_dict(data: dict[str, Any]) -> MultiModalItem:
    return MultiModalItem(data["hash"], data["offset"], data["length"], base64.b64decode(data["pixel_values"]),
                          tuple(data["shape"]))
