"""`Scheduler`: the policy entry point: accept, place, schedule, apply outputs, abort.

RULE (hot path, as vLLM V2's model runner): this module is shared by every model and task;
feature logic lives elsewhere and is called from here: round planning in round_builder.py
(chunked prefill, preemption), multi_step.py (steps per round), pooling.py (prefill-only
models), placement.py (data parallel), output_processor.py (stops), kv_block_manager.py
(blocks, prefix cache), backpressure.py (queue bounds). Everything here is O(changed) per call except `schedule`, whose
cost is proportional to the requests it puts in the round. No I/O, no asyncio, no protobuf.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Sequence

from services.scheduler.backpressure import queue_full_error
from services.scheduler.config import SchedulerConfig
from services.scheduler.encoder_budget import (
    EncoderBudget,
    check_worker_capacity,
    derive_encoder_budget,
    mm_items_error,
)
from services.scheduler.info import SchedulerInfo, SchedulerStats
from services.scheduler.observer import RequestObserver
from services.scheduler.output_processor import OutputProcessor
from services.scheduler.placement import choose_worker
from services.scheduler.pooling import build_pooling_round
from services.scheduler.request import Request, RequestStatus
from services.scheduler.round_builder import RoundBuilder
from services.scheduler.updates import RequestError, RequestUpdate, UpdateSink
from services.scheduler.worker_state import WorkerState
from shared.errors import ErrorKind
from shared.execute import ExecuteRound, StepOutput, WorkerInfo
from shared.types import RequestKind, StopReason

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over one or more data-parallel workers.

    Args:
        config: limits and feature switches.
        worker_infos: what each worker reported (same model, task and block size on all).
        worker_addresses: for messages only.
        observer: lifecycle hooks for spans and metrics (none: no telemetry).
    """

    def __init__(self, config: SchedulerConfig, worker_infos: Sequence[WorkerInfo],
                 worker_addresses: Sequence[str] = (), observer: RequestObserver | None = None) -> None:
        if not worker_infos:
            raise ValueError("the scheduler needs at least one worker")
        first = worker_infos[0]
        for info in worker_infos[1:]:
            if (info.model_id, info.task, info.block_size) != (first.model_id, first.task, first.block_size):
                raise ValueError(f"workers disagree: {first} vs {info}")
        addresses = list(worker_addresses) or [f"worker-{i}" for i in range(len(worker_infos))]
        self.config = config
        self.task = first.task
        self.model_id = first.model_id
        self.max_model_len = min(info.max_model_len for info in worker_infos)
        self.encoder_budget = self._encoder_budget(config, worker_infos, addresses)
        self.workers = [WorkerState(i, addresses[i], info, config.enable_prefix_caching, observer,
                                    self.encoder_budget)
                        for i, info in enumerate(worker_infos)]
        self._observer = observer
        self._homeless: list[Request] = []  # requests waiting for any worker to be alive
        self.max_request_tokens = self._max_request_tokens(worker_infos)
        self.requests: dict[str, Request] = {}
        self._by_connection: dict[int, set[str]] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._arrival = itertools.count()
        self._builder = RoundBuilder(config, self.max_model_len)
        self._outputs = OutputProcessor(first.eos_token_ids, self.max_model_len)
        self.vocab_size = first.vocab_size
        self.num_steps = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0

    # ---- requests in ----

    def add_request(self, request: Request, sink: UpdateSink) -> None:
        """Queue a request on a worker, or finish it at once with an error update."""
        error = self._validate(request) or queue_full_error(self.workers, request, self.config)
        ws = None
        leader = self._prompt_leader(request)
        if error is None:
            ws = self.workers[leader.worker_index] if leader is not None and leader.worker_index is not None \
                else choose_worker(self.workers, request)
            if ws is None:
                error = RequestError(ErrorKind.UNAVAILABLE, "no worker is available: every worker failed")
        if error is not None or ws is None:
            self.num_failed += 1
            sink.add(request.connection_id, RequestUpdate(request.request_id, error=error))
            return
        request.arrival_seq = next(self._arrival)
        self.requests[request.request_id] = request
        self._by_connection.setdefault(request.connection_id, set()).add(request.request_id)
        if request.deadline_unix_s > 0:
            heapq.heappush(self._deadlines, (request.deadline_unix_s, request.arrival_seq, request.request_id))
        ws.add(request, hold_for=leader)
        logger.debug("queued on worker %d (priority %d, %d prompt tokens)", ws.index, request.priority,
                     request.num_prompt_tokens, extra={"request_id": request.request_id})

    def abort_request(self, request_id: str, sink: UpdateSink | None) -> bool:
        """Abort a live request (frees its blocks now); unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.worker_index is None:  # held for a worker to come back
            self._homeless.remove(request)
            request.status, request.stop_reason = RequestStatus.FINISHED, StopReason.ABORTED
            if self._observer is not None:
                self._observer.on_finished(request, StopReason.ABORTED, -1)
        else:
            self.workers[request.worker_index].finish(request, StopReason.ABORTED)
        self._forget(request)
        if sink is not None:
            sink.add(request.connection_id, RequestUpdate(
                request_id, stop_reason=StopReason.ABORTED, num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens))
        logger.debug("aborted", extra={"request_id": request_id})
        return True

    def abort_connection(self, connection_id: int) -> int:
        """The frontend stream ended: abort its unfinished requests (nobody to tell)."""
        request_ids = list(self._by_connection.get(connection_id, ()))
        for request_id in request_ids:
            self.abort_request(request_id, None)
        return len(request_ids)

    def expire_deadlines(self, now: float, sink: UpdateSink) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            request_id = heapq.heappop(self._deadlines)[2]
            self.abort_request(request_id, sink)

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    def num_unfinished(self, connection_id: int) -> int:
        return len(self._by_connection.get(connection_id, ()))

    # ---- rounds out, outputs in ----

    def take_aborts(self) -> dict[int, list[str]]:
        """Requests aborted on each worker since the last call, to send before the next round.

        Their blocks are free already, and the steps in flight still list them (placeholder
        tokens, discarded as the request is FINISHED), so nothing here waits on the worker.
        """
        return {ws.index: ids for ws in self.workers if (ids := ws.take_abort_ids())}

    def schedule(self) -> dict[int, ExecuteRound]:
        """The next round for every worker that may take one and has work."""
        rounds: dict[int, ExecuteRound] = {}
        max_inflight, quiet = self.config.max_inflight_rounds, self.config.pipeline_quiet_rounds
        lead_s = self.config.pipeline_lead_ms / 1000
        for ws in self.workers:
            if not ws.can_take_round(max_inflight, quiet, lead_s):
                continue
            rnd = self._builder.build(ws) if ws.kv is not None else build_pooling_round(ws, self.config)
            if rnd is not None:
                rounds[ws.index] = rnd
                ws.observer.on_round(ws.index, rnd, len(ws.inflight[-1].sampler_ids))
        return rounds

    def update_from_output(self, worker_index: int, output: StepOutput, sink: UpdateSink) -> None:
        """Apply one step's output (raises ProtocolError if the worker broke the protocol)."""
        for request in self._outputs.process(self.workers[worker_index], output, sink):
            self._forget(request)
        self.num_steps += 1

    def fail_worker(self, worker_index: int, message: str, sink: UpdateSink) -> None:
        """The worker died or failed a round: move its requests to live workers (or hold them).

        Nothing is lost: each request recomputes prompt + the output already sent, on another
        worker, or on this one when it rejoins. A request that was on `max_worker_failures`
        failing workers is failed alone (it may be what breaks them).
        """
        ws = self.workers[worker_index]
        if not ws.is_alive:
            return
        ws.is_alive = False
        moved = ws.evict_all()
        limit = self.config.max_worker_failures
        for request in moved:
            request.num_worker_failures += 1
            if request.num_worker_failures >= limit:
                self._fail_alone(request, ws.index, f"it was on {limit} workers that failed (last: {message})", sink)
            else:
                self._place(request)
        logger.error("worker %d (%s) failed: %s; %d request(s) moved; %d worker(s) left", worker_index, ws.address,
                     message, len(moved), sum(w.is_alive for w in self.workers))

    def revive_worker(self, worker_index: int, info: WorkerInfo) -> None:
        """The worker is back (restarted or reconnected), empty: it takes requests again."""
        ws = self.workers[worker_index]
        first = self.workers[0 if worker_index else -1].info
        if (info.model_id, info.task, info.block_size) != (first.model_id, first.task, first.block_size):
            raise ValueError(f"worker {ws.address} came back serving something else: {info}")
        ws.info = info
        ws.evict_all()  # a fresh pool sized as it reports now
        ws.is_alive = True
        homeless, self._homeless = self._homeless, []
        for request in homeless:
            self._place(request)
        logger.info("worker %d (%s) rejoined; %d held request(s) placed", worker_index, ws.address, len(homeless))

    def _place(self, request: Request) -> None:
        ws = choose_worker(self.workers, request)
        if ws is None:
            self._homeless.append(request)  # no live worker: wait for one to return
        else:
            ws.add(request)

    def _fail_alone(self, request: Request, worker_index: int, reason: str, sink: UpdateSink) -> None:
        request.status = RequestStatus.FINISHED
        self._forget(request)
        if self._observer is not None:
            self._observer.on_finished(request, None, worker_index)
        sink.add(request.connection_id, RequestUpdate(request.request_id, error=RequestError(
            ErrorKind.INTERNAL, f"request {request.request_id} failed: {reason}")))

    @property
    def has_live_workers(self) -> bool:
        return any(ws.is_alive for ws in self.workers)

    def stats(self) -> SchedulerStats:
        kvs = [ws.kv for ws in self.workers if ws.kv is not None]
        return SchedulerStats(
            num_steps=self.num_steps,
            num_rounds=sum(ws.num_rounds for ws in self.workers),
            num_preemptions=sum(ws.num_preemptions for ws in self.workers),
            num_prefix_query_tokens=sum(kv.num_query_tokens for kv in kvs),
            num_prefix_hit_tokens=sum(kv.num_hit_tokens for kv in kvs),
            num_running=sum(len(ws.running) + len(ws.pooling_inflight) for ws in self.workers),
            num_waiting=(sum(len(ws.waiting) + len(ws.draining) + len(ws.held) for ws in self.workers)
                         + len(self._homeless)),
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
            num_failed=self.num_failed,
            num_free_blocks=sum(kv.num_free_blocks for kv in kvs),
            num_kv_blocks=sum(kv.num_blocks for kv in kvs),
        )

    def info(self) -> SchedulerInfo:
        return SchedulerInfo(
            ready=self.has_live_workers,
            model_id=self.model_id,
            task=self.task,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            num_workers=len(self.workers),
            num_kv_blocks=sum(ws.info.num_kv_blocks for ws in self.workers),
            block_size=self.workers[0].info.block_size,
            max_request_tokens=self.max_request_tokens,
            stats=self.stats(),
            mm_tokens_per_item=self.encoder_budget.tokens_per_item if self.encoder_budget else 0,
            limit_mm_per_prompt=self.config.limit_mm_per_prompt if self.encoder_budget else 0,
        )

    # ---- helpers ----

    def _forget(self, request: Request) -> None:
        del self.requests[request.request_id]
        if request.stop_reason is None:
            self.num_failed += 1
        elif request.stop_reason is StopReason.ABORTED:
            self.num_aborted += 1
        else:
            self.num_finished += 1
        ids = self._by_connection.get(request.connection_id)
        if ids is not None:
            ids.discard(request.request_id)
            if not ids:
                del self._by_connection[request.connection_id]

    def _prompt_leader(self, request: Request) -> Request | None:
        """The group's first sample to hold `request` for, or None to queue it at once.

        Held only while sharing can work: prefix caching on, a prompt of at least one full
        block before its last token, and the first sample live on a
        worker, from the same frontend, and not yet sampling (else its prompt is cached already,
        or will not be, and the placement by prefix hit does the rest).
        """
        if not request.shares_prompt_with or not self.config.enable_prefix_caching:
            return None
        if (request.num_tokens - 1) // self.workers[0].info.block_size == 0:
            return None  # no full block to share: waiting would only delay it
        leader = self.requests.get(request.shares_prompt_with)
        if (leader is None or leader.worker_index is None or leader.connection_id != request.connection_id
                or leader.num_output_tokens > 0
                or leader.status not in (RequestStatus.WAITING, RequestStatus.RUNNING)):
            return None
        return leader

    def _max_request_tokens(self, infos: Sequence[WorkerInfo]) -> int:
        """Longest prompt + output one worker's pool can hold, with multi-step lookahead slack."""
        if self.task is not RequestKind.GENERATE:
            return self.max_model_len
        capacity = min(info.num_kv_blocks * info.block_size for info in infos)
        return min(self.max_model_len, capacity - (self.config.num_scheduler_steps - 1))

    @staticmethod
    def _encoder_budget(config: SchedulerConfig, infos: Sequence[WorkerInfo],
                        addresses: Sequence[str]) -> EncoderBudget | None:
        """Vision-language models: the budget seed 003 derives, checked against every worker."""
        tokens_per_item = infos[0].mm_tokens_per_item
        if tokens_per_item <= 0:
            return None
        budget = derive_encoder_budget(tokens_per_item, config.max_num_batched_tokens, config.max_num_seqs,
                                       config.limit_mm_per_prompt)
        for info, address in zip(infos, addresses, strict=True):
            check_worker_capacity(budget, info.encoder_cache_tokens, address)
        logger.info("encoder budget: %d tokens per round, %d cached (%d images of %d tokens)",
                    budget.compute_tokens, budget.cache_tokens, budget.max_items_cached, tokens_per_item)
        return budget

    def _validate(self, request: Request) -> RequestError | None:
        def invalid(message: str) -> RequestError:
            return RequestError(ErrorKind.INVALID_ARGUMENT, message)

        if (mm_error := mm_items_error(request.mm_items, request.num_prompt_tokens, self.encoder_budget,
                                       self.config.limit_mm_per_prompt)) is not None:
            return invalid(mm_error)

        if request.request_id in self.requests:
            return invalid(f"request_id={request.request_id!r} is already in use")
        if (request.kind is RequestKind.GENERATE) != (self.task is RequestKind.GENERATE):
            return invalid(f"the model {self.model_id} serves {self.task.name.lower()} requests, "
                           f"not {request.kind.name.lower()}")
        if not request.prompt_token_ids:
            return invalid("the prompt is empty")
        if request.num_prompt_tokens > self.max_model_len:
            return invalid(f"the prompt has {request.num_prompt_tokens} tokens; the model takes at most "
                           f"{self.max_model_len}")
        if request.is_generate:
            if request.sampling.max_tokens < 1:
                return invalid(f"max_tokens={request.sampling.max_tokens} must be >= 1")
            needed = request.max_total_tokens(self.max_model_len)
            if needed > self.max_request_tokens:
                return invalid(f"prompt ({request.num_prompt_tokens}) + max_tokens "
                               f"({request.sampling.max_tokens}) needs {needed} tokens of KV cache; one "
                               f"worker holds at most {self.max_request_tokens}")
        return None
