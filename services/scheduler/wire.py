"""scheduler.proto <-> scheduler dataclasses. With servicer.py, the only *_pb2 importer here.

Worker messages are converted by `shared/execute_wire.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.info import SchedulerInfo
from services.scheduler.request import Request
from services.scheduler.updates import RequestError, RequestUpdate
from shared.errors import ErrorKind
from shared.execute_wire import mm_item_from_proto, mm_item_to_proto, sampling_from_proto, sampling_to_proto
from shared.pb.spindle.v1 import common_pb2, scheduler_pb2
from shared.types import RequestKind, StopReason


def request_from_proto(msg: scheduler_pb2.AddRequest, connection_id: int) -> Request:
    request = Request(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling),
        kind=RequestKind(msg.kind) if msg.kind else RequestKind.GENERATE,
        priority=msg.priority,
        connection_id=connection_id,
        frontend_id=msg.frontend_id,
        traceparent=msg.traceparent,
        deadline_unix_s=msg.deadline_unix_s,
        cache_salts=tuple(msg.cache_salts),
        token_type_ids=list(msg.token_type_ids),
        normalize=msg.normalize,
        output_token_ids=list(msg.output_token_ids),
        shares_prompt_with=msg.shares_prompt_with,
        mm_items=tuple(mm_item_from_proto(item) for item in msg.mm_items),
    )
    request.is_resumed = msg.resumed
    return request


def add_requests_to_proto(requests: Sequence[Request]) -> scheduler_pb2.ConnectRequest:
    """For clients and tests: the Connect message adding `requests`."""
    return scheduler_pb2.ConnectRequest(add=scheduler_pb2.AddRequests(requests=[
        scheduler_pb2.AddRequest(
            request_id=r.request_id, kind=int(r.kind), prompt_token_ids=r.prompt_token_ids,
            token_type_ids=r.token_type_ids, sampling=sampling_to_proto(r.sampling), priority=r.priority,
            traceparent=r.traceparent, deadline_unix_s=r.deadline_unix_s, cache_salts=r.cache_salts,
            output_token_ids=r.output_token_ids, resumed=r.is_resumed, shares_prompt_with=r.shares_prompt_with,
            frontend_id=r.frontend_id, mm_items=[mm_item_to_proto(item) for item in r.mm_items],
            normalize=r.normalize,
        )
        for r in requests
    ]))


def abort_requests_to_proto(request_ids: Sequence[str]) -> scheduler_pb2.ConnectRequest:
    return scheduler_pb2.ConnectRequest(abort=scheduler_pb2.AbortRequests(request_ids=request_ids))


def update_to_proto(u: RequestUpdate) -> scheduler_pb2.RequestUpdate:
    msg = scheduler_pb2.RequestUpdate(
        request_id=u.request_id, token_ids=u.token_ids, logprobs=u.logprobs,
        num_top_logprobs=u.num_top_logprobs, top_token_ids=u.top_token_ids, top_logprobs=u.top_logprobs,
        stop_reason=int(u.stop_reason) if u.stop_reason is not None else 0,
        num_prompt_tokens=u.num_prompt_tokens, num_cached_tokens=u.num_cached_tokens, pooled=u.pooled,
    )
    if u.stop_token_id is not None:
        msg.stop_token_id = u.stop_token_id
    if u.error is not None:
        msg.error.CopyFrom(common_pb2.RequestError(kind=int(u.error.kind), message=u.error.message))
    return msg


def update_from_proto(msg: scheduler_pb2.RequestUpdate) -> RequestUpdate:
    return RequestUpdate(
        request_id=msg.request_id, token_ids=list(msg.token_ids), logprobs=list(msg.logprobs),
        num_top_logprobs=msg.num_top_logprobs, top_token_ids=list(msg.top_token_ids),
        top_logprobs=list(msg.top_logprobs),
        stop_reason=StopReason(msg.stop_reason) if msg.stop_reason else None,
        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        num_prompt_tokens=msg.num_prompt_tokens, num_cached_tokens=msg.num_cached_tokens,
        pooled=list(msg.pooled),
        error=RequestError(ErrorKind(msg.error.kind), msg.error.message) if msg.error.kind else None,
    )


def step_updates_to_proto(updates: Sequence[RequestUpdate], sampled_unix_ns: int = 0) -> scheduler_pb2.ConnectResponse:
    return scheduler_pb2.ConnectResponse(step=scheduler_pb2.StepUpdates(
        updates=[update_to_proto(u) for u in updates], sampled_unix_ns=sampled_unix_ns))


def info_to_proto(info: SchedulerInfo) -> scheduler_pb2.GetSchedulerInfoResponse:
    s = info.stats
    return scheduler_pb2.GetSchedulerInfoResponse(
        ready=info.ready, model_id=info.model_id, task=int(info.task), max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, num_workers=info.num_workers, num_kv_blocks=info.num_kv_blocks,
        block_size=info.block_size, max_request_tokens=info.max_request_tokens,
        mm_tokens_per_item=info.mm_tokens_per_item, limit_mm_per_prompt=info.limit_mm_per_prompt,
        normalizes_embeddings=True,  # AddRequest.normalize reaches the workers (pooling.py)
        stats=scheduler_pb2.SchedulerStats(
            num_steps=s.num_steps, num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.num_prefix_query_tokens, prefix_cache_hits=s.num_prefix_hit_tokens,
            num_running=s.num_running, num_waiting=s.num_waiting, num_finished=s.num_finished,
            num_aborted=s.num_aborted,
        ),
    )
