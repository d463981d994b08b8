"""Conversion between the frontend's dataclasses and generation.proto / scheduler.proto.

With servicer.py and scheduler_client.py, the only frontend module that touches *_pb2.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.frontend.messages import (
    AddRequest,
    EmbedInput,
    FinishReason,
    GenerateChunk,
    GenerateComplete,
    GenerateInput,
    ModelCard,
    PoolingResult,
    RequestUpdate,
    SamplingRequest,
    SchedulerInfo,
    ScoreInput,
    TokenizeResult,
    Usage,
)
from shared.errors import ErrorKind, SpindleError, error_from_kind
from shared.execute_wire import mm_item_to_proto, sampling_to_proto
from shared.grammar import Grammar, GrammarKind
from shared.pb.spindle.v1 import common_pb2, generation_pb2, scheduler_pb2
from shared.types import RequestKind, StopReason

# ---- scheduler.proto ------------------------------------------------------------------------


def add_request_to_proto(r: AddRequest, frontend_id: str = "") -> scheduler_pb2.AddRequest:
    """Raises ValueError for a field its wire type cannot carry (an int out of range, a string
    that is not Unicode): convert each request alone, so one cannot sink a whole batch."""
    return scheduler_pb2.AddRequest(
        request_id=r.request_id,
        kind=int(r.kind),
        prompt_token_ids=r.prompt_token_ids,
        token_type_ids=r.token_type_ids,
        sampling=sampling_to_proto(r.sampling),
        priority=r.priority,
        traceparent=r.traceparent,
        deadline_unix_s=r.deadline_unix_s,
        output_token_ids=r.output_token_ids,
        resumed=r.resumed,
        shares_prompt_with=r.shares_prompt_with,
        mm_items=[mm_item_to_proto(item) for item in r.mm_items],
        frontend_id=frontend_id,
        normalize=r.normalize,
    )


def resubmitted_to_proto(frontend_id: str) -> scheduler_pb2.ConnectRequest:
    """The marker after a (re)connection's re-submissions: see `Resubmitted` in scheduler.proto."""
    return scheduler_pb2.ConnectRequest(resubmitted=scheduler_pb2.Resubmitted(frontend_id=frontend_id))


def add_requests_to_proto(requests: Sequence[scheduler_pb2.AddRequest]) -> scheduler_pb2.ConnectRequest:
    """One ConnectRequest carrying every AddRequest issued in one loop iteration."""
    return scheduler_pb2.ConnectRequest(add=scheduler_pb2.AddRequests(requests=requests))


def rejection_to_proto(request_id: str, error: SpindleError) -> scheduler_pb2.ConnectResponse:
    """A step holding only `error` as the final update of `request_id`: what the scheduler sends
    when it refuses a request, for one the frontend refuses itself."""
    update = scheduler_pb2.RequestUpdate(request_id=request_id,
                                         error=common_pb2.RequestError(kind=int(error.kind), message=error.message))
    return scheduler_pb2.ConnectResponse(step=scheduler_pb2.StepUpdates(updates=[update]))


def abort_requests_to_proto(request_ids: Sequence[str]) -> scheduler_pb2.ConnectRequest:
    return scheduler_pb2.ConnectRequest(abort=scheduler_pb2.AbortRequests(request_ids=request_ids))


def _error_from_proto(msg: common_pb2.RequestError) -> SpindleError:
    try:
        kind = ErrorKind(msg.kind)
    except ValueError:
        kind = ErrorKind.INTERNAL
    return error_from_kind(kind, msg.message or "the scheduler failed the request")


def update_from_proto(msg: scheduler_pb2.RequestUpdate) -> RequestUpdate:
    # Repeated fields are copied with [:]: list() walks them by index until an IndexError is
    # raised and formatted (protobuf's upb containers have no __iter__), twice the time a field,
    # for every request at every step (3.5 -> 2.2 us an update).
    return RequestUpdate(
        request_id=msg.request_id,
        token_ids=msg.token_ids[:],
        logprobs=msg.logprobs[:],
        num_top_logprobs=msg.num_top_logprobs,
        top_token_ids=msg.top_token_ids[:],
        top_logprobs=msg.top_logprobs[:],
        stop_reason=StopReason(msg.stop_reason) if msg.stop_reason else None,
        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        pooled=msg.pooled[:],
        error=_error_from_proto(msg.error) if msg.HasField("error") and msg.error.kind else None,
    )


def info_from_proto(msg: scheduler_pb2.GetSchedulerInfoResponse) -> SchedulerInfo:
    return SchedulerInfo(
        ready=msg.ready,
        model_id=msg.model_id,
        task=RequestKind(msg.task) if msg.task else RequestKind.GENERATE,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        num_workers=msg.num_workers,
        num_kv_blocks=msg.num_kv_blocks,
        block_size=msg.block_size,
        max_request_tokens=msg.max_request_tokens,
        mm_tokens_per_item=msg.mm_tokens_per_item,
        limit_mm_per_prompt=msg.limit_mm_per_prompt,
        normalizes_embeddings=msg.normalizes_embeddings,
        step_port=msg.step_port,
        step_local_socket=msg.step_local_socket,
    )


# ---- generation.proto -----------------------------------------------------------------------

_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                             "presence_penalty", "frequency_penalty", "max_tokens", "logprobs", "min_tokens")

FINISH_REASONS: dict[FinishReason, int] = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
}

MODEL_TASKS: dict[RequestKind, int] = {
    RequestKind.GENERATE: generation_pb2.MODEL_TASK_GENERATE,
    RequestKind.EMBED: generation_pb2.MODEL_TASK_EMBED,
    RequestKind.SCORE: generation_pb2.MODEL_TASK_SCORE,
}


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingRequest:
    values = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    return SamplingRequest(
        **values,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=tuple(msg.logit_bias.items()),
        grammar=grammar_from_proto(msg.structured),
    )


_STRUCTURED_KINDS = {"json_schema": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "lark": GrammarKind.LARK}


def grammar_from_proto(msg: generation_pb2.StructuredOutput) -> Grammar | None:
    """SamplingParams.structured as a Grammar; None when no form is set (or json_object is false)."""
    which = msg.WhichOneof("kind")
    if which is None or (which == "json_object" and not msg.json_object):
        return None
    if which == "json_object":
        return Grammar.json_object()
    return Grammar(_STRUCTURED_KINDS[which], getattr(msg, which))


def generate_input_from_proto(msg: generation_pb2.GenerateRequest) -> GenerateInput:
    which = msg.WhichOneof("prompt")
    return GenerateInput(
        model=msg.model,
        prompt_text=msg.text if which == "text" else None,
        prompt_token_ids=list(msg.token_ids.ids) if which == "token_ids" else None,
        sampling=sampling_from_proto(msg.sampling),
        priority=msg.priority,
        request_id=msg.request_id,
        n=msg.n or 1,
        echo=msg.echo,
        images=list(msg.images),
    )


def chunk_to_proto(chunk: GenerateChunk) -> generation_pb2.GenerateResponse:
    out = generation_pb2.GenerateChunk(token_ids=chunk.token_ids, text=chunk.text, index=chunk.index,
                                       is_prompt=chunk.is_prompt)
    for position in chunk.logprobs or ():
        entry = out.logprobs.add()
        entry.chosen.token_id = position.chosen.token_id
        entry.chosen.logprob = position.chosen.logprob
        for top in position.top:
            entry.top.add(token_id=top.token_id, logprob=top.logprob)
    return generation_pb2.GenerateResponse(request_id=chunk.request_id, chunk=out)


def complete_to_proto(complete: GenerateComplete, system_fingerprint: str = "") -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateComplete(
        finish_reason=FINISH_REASONS[complete.finish_reason],
        usage=_usage_to_proto(complete.usage),
        matched_stop=complete.matched_stop or "",
        index=complete.index,
        system_fingerprint=system_fingerprint,
    )
    if complete.total_usage is not None:
        msg.total_usage.CopyFrom(_usage_to_proto(complete.total_usage))
    return generation_pb2.GenerateResponse(request_id=complete.request_id, complete=msg)


def tokenize_to_proto(result: TokenizeResult, max_model_len: int = 0) -> generation_pb2.TokenizeResponse:
    return generation_pb2.TokenizeResponse(token_ids=result.token_ids, tokens=result.tokens,
                                           max_model_len=max_model_len)


def models_to_proto(cards: Sequence[ModelCard]) -> generation_pb2.ListModelsResponse:
    return generation_pb2.ListModelsResponse(models=[
        generation_pb2.ModelCard(id=c.id, task=MODEL_TASKS[c.task], max_model_len=c.max_model_len)
        for c in cards
    ])


def _usage_to_proto(usage: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                                cached_prompt_tokens=usage.cached_prompt_tokens)


def embed_input_from_proto(msg: generation_pb2.EmbedRequest) -> EmbedInput:
    return EmbedInput(model=msg.model, texts=list(msg.inputs), truncate=msg.truncate,
                      normalize=msg.normalize if msg.HasField("normalize") else None, priority=msg.priority)


def embed_to_proto(result: PoolingResult) -> generation_pb2.EmbedResponse:
    return generation_pb2.EmbedResponse(
        embeddings=[generation_pb2.Embedding(values=v) for v in result.vectors], usage=_usage_to_proto(result.usage))


def score_input_from_proto(msg: generation_pb2.ScoreRequest) -> ScoreInput:
    return ScoreInput(model=msg.model, pairs=[(msg.query, d) for d in msg.documents], truncate=msg.truncate,
                      priority=msg.priority)


def score_to_proto(ranked: list[tuple[int, float]], usage: Usage) -> generation_pb2.ScoreResponse:
    """`ranked`: (document index, score) pairs in the order to return them."""
    return generation_pb2.ScoreResponse(
        scores=[generation_pb2.DocumentScore(index=i, score=score) for i, score in ranked],
        usage=_usage_to_proto(usage))
