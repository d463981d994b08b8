"""Conversion between `shared/execute.py` dataclasses and worker.proto / common.proto.

The only place besides the servicers that touches the generated *_pb2 classes for the
scheduler-worker protocol.
"""

from __future__ import annotations

from shared.errors import InvalidArgumentError
from shared.execute import (
    AbortRows,
    CachedRequestData,
    ExecuteRound,
    MultiModalItem,
    NewRequestData,
    PoolingRequestData,
    StepOutput,
    WorkerInfo,
)
from shared.grammar import Grammar, GrammarKind
from shared.pb.spindle.v1 import common_pb2, worker_pb2
from shared.sampling import SamplingOptions
from shared.types import RequestKind


def sampling_to_proto(options: SamplingOptions) -> common_pb2.SamplingOptions:
    msg = common_pb2.SamplingOptions(
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        min_p=options.min_p,
        repetition_penalty=options.repetition_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        max_tokens=options.max_tokens,
        min_tokens=options.min_tokens,
        stop_token_ids=options.stop_token_ids,
        ignore_eos=options.ignore_eos,
        logit_bias=dict(options.logit_bias),
    )
    if options.seed is not None:
        msg.seed = options.seed
    if options.logprobs is not None:
        msg.logprobs = options.logprobs
    if options.grammar is not None:
        msg.grammar.kind = options.grammar.kind.value
        msg.grammar.spec = options.grammar.spec
    return msg


def sampling_from_proto(msg: common_pb2.SamplingOptions) -> SamplingOptions:
    return SamplingOptions(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        grammar=grammar_from_proto(msg.grammar) if msg.HasField("grammar") else None,
    )


def grammar_from_proto(msg: common_pb2.GrammarSpec) -> Grammar:
    try:
        kind = GrammarKind(msg.kind)
    except ValueError:
        raise InvalidArgumentError(f"unknown grammar kind {msg.kind!r}") from None
    return Grammar(kind, msg.spec)


def mm_item_to_proto(item: MultiModalItem) -> common_pb2.MultiModalItem:
    return common_pb2.MultiModalItem(hash=item.hash, offset=item.offset, length=item.length,
                                     pixel_values=item.pixel_values, shape=item.shape)


def mm_item_from_proto(msg: common_pb2.MultiModalItem) -> MultiModalItem:
    return MultiModalItem(msg.hash, msg.offset, msg.length, msg.pixel_values, tuple(msg.shape))


def round_to_proto(r: ExecuteRound) -> worker_pb2.ExecuteRequest:
    cached = r.cached_requests
    return worker_pb2.ExecuteRequest(
        round_id=r.round_id,
        num_steps=r.num_steps,
        new_requests=[
            worker_pb2.NewRequestData(
                request_id=n.request_id,
                token_ids=n.token_ids,
                num_prompt_tokens=n.num_prompt_tokens,
                num_computed_tokens=n.num_computed_tokens,
                block_ids=n.block_ids,
                sampling=sampling_to_proto(n.sampling),
                traceparent=n.traceparent,
                mm_items=[mm_item_to_proto(item) for item in n.mm_items],
            )
            for n in r.new_requests
        ],
        cached_requests=worker_pb2.CachedRequestData(
            request_ids=cached.request_ids,
            num_new_block_ids=[len(b) for b in cached.new_block_ids],
            new_block_ids=[b for blocks in cached.new_block_ids for b in blocks],
        ),
        num_scheduled_tokens=r.num_scheduled_tokens,
        finished_request_ids=r.finished_request_ids,
        pooling_requests=[
            worker_pb2.PoolingRequestData(
                request_id=p.request_id,
                kind=int(p.kind),
                token_ids=p.token_ids,
                token_type_ids=p.token_type_ids,
                normalize=p.normalize,
                traceparent=p.traceparent,
            )
            for p in r.pooling_requests
        ],
        encoder_free_hashes=r.encoder_free_hashes,
        encoder_hashes=r.encoder_hashes,
    )


def abort_to_proto(abort: AbortRows) -> worker_pb2.ExecuteRequest:
    return worker_pb2.ExecuteRequest(aborted_request_ids=abort.request_ids)


def execute_request_to_proto(item: ExecuteRound | AbortRows) -> worker_pb2.ExecuteRequest:
    return abort_to_proto(item) if isinstance(item, AbortRows) else round_to_proto(item)


def execute_request_from_proto(msg: worker_pb2.ExecuteRequest) -> ExecuteRound | AbortRows:
    """A round, or an abort (a message with aborted_request_ids carries no round)."""
    if msg.aborted_request_ids:
        return AbortRows(msg.aborted_request_ids[:])
    return round_from_proto(msg)


def round_from_proto(msg: worker_pb2.ExecuteRequest) -> ExecuteRound:
    cached = msg.cached_requests
    new_block_ids: list[list[int]] = []
    flat = cached.new_block_ids[:]
    start = 0
    for count in cached.num_new_block_ids:
        new_block_ids.append(flat[start : start + count])
        start += count
    return ExecuteRound(
        round_id=msg.round_id,
        num_steps=msg.num_steps,
        new_requests=[
            NewRequestData(
                request_id=n.request_id,
                token_ids=n.token_ids[:],
                num_prompt_tokens=n.num_prompt_tokens,
                num_computed_tokens=n.num_computed_tokens,
                block_ids=n.block_ids[:],
                sampling=sampling_from_proto(n.sampling),
                traceparent=n.traceparent,
                mm_items=[mm_item_from_proto(item) for item in n.mm_items],
            )
            for n in msg.new_requests
        ],
        cached_requests=CachedRequestData(request_ids=cached.request_ids[:], new_block_ids=new_block_ids),
        num_scheduled_tokens=msg.num_scheduled_tokens[:],
        finished_request_ids=msg.finished_request_ids[:],
        pooling_requests=[
            PoolingRequestData(
                request_id=p.request_id,
                kind=RequestKind(p.kind),
                token_ids=p.token_ids[:],
                token_type_ids=p.token_type_ids[:],
                normalize=p.normalize,
                traceparent=p.traceparent,
            )
            for p in msg.pooling_requests
        ],
        encoder_free_hashes=msg.encoder_free_hashes[:],
        encoder_hashes=msg.encoder_hashes[:],
    )


def step_to_proto(s: StepOutput) -> worker_pb2.ExecuteResponse:
    return worker_pb2.ExecuteResponse(
        round_id=s.round_id,
        step_index=s.step_index,
        request_ids=s.request_ids,
        token_ids=s.token_ids,
        logprobs=s.logprobs,
        num_top_logprobs=s.num_top_logprobs,
        top_token_ids=s.top_token_ids,
        top_logprobs=s.top_logprobs,
        pooled_outputs=[worker_pb2.PooledOutput(request_id=k, values=v) for k, v in s.pooled.items()],
        is_last_step=s.is_last_step,
        sampled_unix_ns=s.sampled_unix_ns,
    )


def step_from_proto(msg: worker_pb2.ExecuteResponse) -> StepOutput:
    # Repeated fields are copied with [:] (here and above): list() walks them by index until an
    # IndexError is raised and formatted (protobuf's upb containers have no __iter__), twice the
    # time a field, on every step (4.1 -> 2.8 us for a one-row step, 7.1 -> 5.2 for 64 rows).
    return StepOutput(
        round_id=msg.round_id,
        step_index=msg.step_index,
        request_ids=msg.request_ids[:],
        token_ids=msg.token_ids[:],
        logprobs=msg.logprobs[:],
        num_top_logprobs=msg.num_top_logprobs[:],
        top_token_ids=msg.top_token_ids[:],
        top_logprobs=msg.top_logprobs[:],
        pooled={p.request_id: p.values[:] for p in msg.pooled_outputs},
        is_last_step=msg.is_last_step,
        sampled_unix_ns=msg.sampled_unix_ns,
    )


def worker_info_to_proto(info: WorkerInfo) -> worker_pb2.GetWorkerInfoResponse:
    return worker_pb2.GetWorkerInfoResponse(
        model_id=info.model_id,
        task=int(info.task),
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        eos_token_ids=info.eos_token_ids,
        attention_backend=info.attention_backend,
        dtype=info.dtype,
        device=info.device,
        pooled_size=info.pooled_size,
        mm_tokens_per_item=info.mm_tokens_per_item,
        encoder_cache_tokens=info.encoder_cache_tokens,
        step_port=info.step_port,
        step_local_socket=info.step_local_socket,
    )


def worker_info_from_proto(msg: worker_pb2.GetWorkerInfoResponse) -> WorkerInfo:
    return WorkerInfo(
        model_id=msg.model_id,
        task=RequestKind(msg.task),
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        block_size=msg.block_size,
        num_kv_blocks=msg.num_kv_blocks,
        eos_token_ids=tuple(msg.eos_token_ids),
        attention_backend=msg.attention_backend,
        dtype=msg.dtype,
        device=msg.device,
        pooled_size=msg.pooled_size,
        mm_tokens_per_item=msg.mm_tokens_per_item,
        encoder_cache_tokens=msg.encoder_cache_tokens,
        step_port=msg.step_port,
        step_local_socket=msg.step_local_socket,
    )
