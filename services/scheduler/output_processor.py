"""`OutputProcessor`: applies one worker `StepOutput` to requests and emits frontend updates.

Appends sampled tokens, decides token-level stops (EOS, stop ids, max_tokens, min_tokens,
max_model_len), finishes requests (freeing blocks), registers newly computed full blocks in
the prefix cache, and checks that the worker kept the round protocol. Never schedules.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.scheduler.request import Request, RequestStatus
from services.scheduler.updates import RequestUpdate, UpdateSink
from services.scheduler.worker_state import InflightRound, WorkerState
from shared.execute import StepOutput
from shared.types import StopReason


class ProtocolError(Exception):
    """A worker's step output does not match the rounds it was sent."""


class OutputProcessor:
    """Stateless apart from the model's stop constants."""

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def process(self, ws: WorkerState, output: StepOutput, sink: UpdateSink) -> list[Request]:
        """Apply `output`; returns the requests it finished. Validates before mutating."""
        rnd = self._check(ws, output)
        finished: list[Request] = []
        if rnd.pooling_request_ids:
            self._apply_pooled(ws, rnd, output, sink, finished)
        else:
            if output.step_index == 0:
                self._confirm_chunks(ws, rnd)
            self._apply_tokens(ws, rnd, output, sink, finished)
        ws.step_returned(rnd, output.sampled_unix_ns)
        if output.is_last_step:
            ws.inflight.popleft()
            ws.round_done(rnd)
        return finished

    def check_stop(self, request: Request, token_id: int) -> StopReason | None:
        """Token-level stop after `token_id` was appended (stop tokens only past min_tokens)."""
        sampling = request.sampling
        num_output = len(request.output_token_ids)
        if num_output > sampling.min_tokens and (
            (token_id in self.eos_token_ids and not sampling.ignore_eos)
            or token_id in sampling.stop_token_ids
        ):
            return StopReason.STOP_TOKEN
        if num_output >= sampling.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return StopReason.LENGTH
        return None

    # ---- helpers ----

    def _check(self, ws: WorkerState, output: StepOutput) -> InflightRound:
        if not ws.inflight:
            raise ProtocolError(f"worker {ws.index} sent step output for round {output.round_id} "
                                "but no round is in flight")
        rnd = ws.inflight[0]
        if output.round_id != rnd.round_id or output.step_index >= rnd.num_steps:
            raise ProtocolError(f"worker {ws.index} sent round {output.round_id} step "
                                f"{output.step_index}; expected round {rnd.round_id} of "
                                f"{rnd.num_steps} steps")
        if output.is_last_step != (output.step_index == rnd.num_steps - 1):
            raise ProtocolError(f"worker {ws.index}: is_last_step={output.is_last_step} at step "
                                f"{output.step_index} of a {rnd.num_steps}-step round")
        if rnd.pooling_request_ids:
            missing = [r for r in rnd.pooling_request_ids if r not in output.pooled]
            if missing:
                raise ProtocolError(f"worker {ws.index} returned no pooled output for {missing}")
        elif output.request_ids != rnd.sampler_ids or len(output.token_ids) != len(rnd.sampler_ids):
            raise ProtocolError(f"worker {ws.index} round {rnd.round_id} step {output.step_index}: "
                                f"sampled for {len(output.request_ids)} requests, expected "
                                f"{len(rnd.sampler_ids)} in the order scheduled")
        return rnd

    @staticmethod
    def _confirm_chunks(ws: WorkerState, rnd: InflightRound) -> None:
        """Step 0 ran: prefill chunks that sample nothing are confirmed computed now."""
        kv = ws.kv
        if kv is None:
            return
        for entry in rnd.entries:
            if not entry.samples and entry.request.status is RequestStatus.RUNNING:
                kv.cache_blocks(entry.request, entry.step0_end)

    def _apply_tokens(self, ws: WorkerState, rnd: InflightRound, output: StepOutput,
                      sink: UpdateSink, finished: list[Request]) -> None:
        kv = ws.kv
        token_ids = output.token_ids
        logprobs = output.logprobs
        top_counts = output.num_top_logprobs
        top_offset = 0
        for i, request in enumerate(rnd.samplers):
            num_top = top_counts[i] if top_counts else 0
            top_start, top_offset = top_offset, top_offset + num_top
            if request.status is RequestStatus.FINISHED:
                continue  # stopped earlier: tokens after a stop are never forwarded
            token = token_ids[i]
            request.num_inflight_tokens -= 1
            request.append_output_token(token)
            if kv is not None:  # no-op unless it holds blocks, i.e. is RUNNING
                kv.cache_blocks(request, len(request.all_token_ids) - 1)
            if len(request.output_token_ids) == 1:
                ws.observer.on_first_token(request)
                ws.release_held(request)  # its prompt's blocks are cached now: samples held for it share them
            update = RequestUpdate(request.request_id, [token],
                                   num_prompt_tokens=request.num_prompt_tokens,
                                   num_cached_tokens=request.num_cached_tokens)
            if logprobs and request.sampling.logprobs is not None:
                update.logprobs = [logprobs[i]]
                if num_top:
                    update.num_top_logprobs = num_top
                    update.top_token_ids = output.top_token_ids[top_start:top_offset]
                    update.top_logprobs = output.top_logprobs[top_start:top_offset]
            reason = self.check_stop(request, token)
            if reason is not None:
                update.stop_reason = reason
                if reason is StopReason.STOP_TOKEN:
                    update.stop_token_id = token
                ws.finish(request, reason)
                finished.append(request)
            sink.add(request.connection_id, update)

    @staticmethod
    def _apply_pooled(ws: WorkerState, rnd: InflightRound, output: StepOutput, sink: UpdateSink,
                      finished: list[Request]) -> None:
        for request_id in rnd.pooling_request_ids:
            request = ws.pooling_inflight.get(request_id)
            if request is None:
                continue  # aborted while it ran
            ws.finish(request, StopReason.POOLED)
            finished.append(request)
            sink.add(request.connection_id, RequestUpdate(
                request_id, pooled=list(output.pooled[request_id]), stop_reason=StopReason.POOLED,
                num_prompt_tokens=request.num_prompt_tokens))
