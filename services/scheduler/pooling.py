"""Rounds for prefill-only models (embed, score): no KV cache, no decode, no chunking.

A plain token-budget batcher (vLLM PR 8964): whole inputs, FCFS within priority, until
max_num_batched_tokens or max_num_seqs; an input longer than the budget runs alone.
"""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import RequestStatus
from services.scheduler.worker_state import InflightRound, WorkerState
from shared.execute import ExecuteRound, PoolingRequestData
from shared.types import RequestKind


def build_pooling_round(ws: WorkerState, config: SchedulerConfig) -> ExecuteRound | None:
    budget = config.max_num_batched_tokens
    rnd = ExecuteRound(round_id=ws.next_round_id, num_steps=1)
    while ws.waiting and len(rnd.pooling_requests) < config.max_num_seqs:
        request = ws.waiting.peek()
        if request.num_prompt_tokens > budget and rnd.pooling_requests:
            break
        ws.waiting.pop()
        budget -= request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        ws.pooling_inflight[request.request_id] = request
        ws.observer.on_admitted(request, ws.index, 0)
        rnd.pooling_requests.append(PoolingRequestData(
            request_id=request.request_id,
            kind=request.kind,
            token_ids=request.prompt_token_ids,
            token_type_ids=request.token_type_ids,
            normalize=request.normalize and request.kind is RequestKind.EMBED,  # never a score's logit
            traceparent=request.span_traceparent or request.traceparent,
        ))
    if not rnd.pooling_requests:
        return None
    rnd.finished_request_ids = ws.take_finished_ids()
    ws.inflight.append(InflightRound(rnd.round_id, 1, pooling_request_ids=[
        p.request_id for p in rnd.pooling_requests]))
    ws.next_round_id += 1
    ws.num_rounds += 1
    return rnd
