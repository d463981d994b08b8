"""`WorkerState`: everything the scheduler tracks about one data-parallel worker.

Its KV pool, running set, waiting queue, preempted requests still draining, and the rounds in
flight. Lifecycle moves (admit, preempt, finish) live here so every path keeps the same
bookkeeping; which request moves when is decided by the round builder and scheduler.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field

from services.scheduler.encoder_budget import EncoderBudget
from services.scheduler.encoder_cache import EncoderCacheManager
from services.scheduler.held_samples import HeldSamples
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.observer import RequestObserver
from services.scheduler.request import Request, RequestStatus
from services.scheduler.request_queue import WaitingQueue
from shared.execute import WorkerInfo
from shared.types import StopReason

logger = logging.getLogger(__name__)

# Weight of the newest step in the smoothed step time (`WorkerState.step_s`).
STEP_TIME_SMOOTHING = 0.2


def running_order(request: Request) -> tuple[int, int]:
    """Running-set order: higher priority first, then earlier arrival. The last is the victim."""
    return (-request.priority, request.arrival_seq)


@dataclass(slots=True)
class InflightEntry:
    """One request's part in a round that was sent."""

    request: Request
    step0_end: int  # the request's computed count after step 0 of the round
    samples: bool  # its step-0 tokens reach its last known token, so it samples every step


@dataclass(slots=True)
class InflightRound:
    round_id: int
    num_steps: int
    entries: list[InflightEntry] = field(default_factory=list)
    # Requests that sample in every step of the round, in batch order: each StepOutput of the
    # round must list exactly these.
    sampler_ids: list[str] = field(default_factory=list)
    samplers: list[Request] = field(default_factory=list)
    pooling_request_ids: list[str] = field(default_factory=list)
    num_returned: int = 0  # steps whose output came back
    last_sampled_unix_ns: int = 0  # when the worker sampled the last of them (its clock; 0: unknown)

    @property
    def steps_left(self) -> int:
        return self.num_steps - self.num_returned


class WorkerState:
    """Scheduling state of one worker.

    Invariants:
      * each live request placed on this worker is in exactly one of `running` (RUNNING),
        `waiting` (WAITING or PREEMPTED), `draining` (PREEMPTED, rounds still in flight),
        `held` (WAITING: a later sample of an n > 1 request, see held_samples.py), or is a
        pooling request in a round in flight (`pooling_inflight`).
      * `running` is sorted by `running_order`; only RUNNING requests hold KV blocks.
      * `is_on_worker` is True from the round that first carried a request until the round
        listing it in `finished_request_ids` is built.
    """

    def __init__(self, index: int, address: str, info: WorkerInfo, enable_prefix_caching: bool,
                 observer: RequestObserver | None = None, encoder_budget: EncoderBudget | None = None) -> None:
        self.index = index
        self.observer = observer or RequestObserver()
        self.address = address
        self.info = info
        self.kv: KVBlockManager | None = (
            KVBlockManager(info.num_kv_blocks, info.block_size, enable_prefix_caching)
            if info.num_kv_blocks > 0 else None
        )
        # Vision-language models: the worker's encoder cache, budgeted here (encoder_cache.py).
        self.encoder_budget = encoder_budget
        self.encoder = EncoderCacheManager(encoder_budget) if encoder_budget is not None else None
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = WaitingQueue()
        self.draining: dict[str, Request] = {}
        self.held = HeldSamples()
        self.pooling_inflight: dict[str, Request] = {}
        self.inflight: deque[InflightRound] = deque()
        self.pending_finished_ids: list[str] = []
        # Aborted while on the worker: sent at once (`AbortRows`), ahead of the round whose
        # finished_request_ids lists them, so the round computing them drops them within a step.
        self.pending_abort_ids: list[str] = []
        self.next_round_id = 0
        self.is_alive = True
        self.num_preemptions = 0
        self.num_rounds = 0
        # Rounds built since one admitted a request: a measure of whether requests are arriving.
        self.rounds_since_admission = 0
        # The worker's time a decode step (between two outputs of one round), smoothed; None
        # until measured (outputs without a sampling time never measure it).
        self.step_s: float | None = None

    @property
    def load(self) -> int:
        return len(self.requests)

    def can_take_round(self, max_inflight_rounds: int, quiet_rounds: int, lead_s: float = 0.0) -> bool:
        """Whether to build a round now (pipelining: while up to max_inflight_rounds run).

        A round sent ahead hides the scheduler round trip, but a request arriving meanwhile
        waits for it to finish. For 1-step rounds that costs one step; for n-step rounds it
        costs n steps of an idle slot per arrival, which measured worse than the round trip
        while requests keep arriving. So a multi-step round goes ahead only while nobody waits:
        early when no round admitted a request in the last `quiet_rounds` rounds, otherwise
        just in time (`lead_s`): once the round in flight will end within `lead_s` by the
        worker's measured step time, so only arrivals in that last stretch wait the extra
        round. Steps of 1-2 ms (a small model, few streams) then no longer idle through the
        round trip (2 ms) after each admission; steps longer than `lead_s` never go ahead.
        """
        if not self.is_alive or len(self.inflight) >= max_inflight_rounds:
            return False
        if not self.inflight or self.inflight[-1].num_steps == 1 or quiet_rounds == 0:
            return True
        if self.waiting:
            return False  # built now, the round would go without them
        if self.rounds_since_admission >= quiet_rounds:
            return True
        return self.step_s is not None and self.inflight[-1].steps_left * self.step_s <= lead_s

    def step_returned(self, rnd: InflightRound, sampled_unix_ns: int) -> None:
        """One step of `rnd` came back, sampled at `sampled_unix_ns` (the worker's clock; 0: unknown)."""
        if rnd.num_returned and rnd.last_sampled_unix_ns and sampled_unix_ns > rnd.last_sampled_unix_ns:
            seconds = (sampled_unix_ns - rnd.last_sampled_unix_ns) / 1e9
            old = self.step_s
            self.step_s = seconds if old is None else old + STEP_TIME_SMOOTHING * (seconds - old)
        rnd.num_returned += 1
        rnd.last_sampled_unix_ns = sampled_unix_ns

    def add(self, request: Request, hold_for: Request | None = None) -> None:
        """Queue the request; with `hold_for` (its group's first sample, on this worker) hold it
        until that one has computed the shared prompt (`release_held`)."""
        request.worker_index = self.index
        self.requests[request.request_id] = request
        if hold_for is not None:
            self.held.hold(request, hold_for.request_id)
        else:
            self.waiting.push(request)
        self.observer.on_added(request, self.index)

    def release_held(self, leader: Request) -> None:
        """`leader` computed its prompt (or will not): the samples held for it may be admitted.

        They keep their arrival order, right behind the leader's, so they go in ahead of
        requests that came after them.
        """
        for request in self.held.release(leader.request_id):
            self.waiting.push(request)

    def admit(self, request: Request, num_computed_tokens: int) -> None:
        """Waiting -> running (the caller already allocated its blocks)."""
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_computed_tokens
        bisect.insort(self.running, request, key=running_order)
        self.observer.on_admitted(request, self.index, num_computed_tokens)

    def preempt(self, request: Request) -> None:
        """Free the request's blocks; it is re-added later with prompt + generated tokens.

        NOTE (pipelining rule): a request may be preempted while rounds that include it are
        in flight. That is safe for blocks (the worker runs rounds in order, so any later
        owner of a freed block writes it after the stale steps did) and for tokens (steps in
        flight sample valid tokens from the right history; they are appended as they arrive).
        It is re-admitted only after its last round in flight came back (`draining` until
        then), so its new-request token list is complete and no two incarnations overlap.
        """
        assert request.status is RequestStatus.RUNNING
        self.running.remove(request)
        if self.kv is not None:
            self.kv.free(request)
        if self.encoder is not None:
            self.encoder.release_request(request)
        request.status = RequestStatus.PREEMPTED
        self.release_held(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_on_worker(request)
        self.observer.on_preempted(request, self.index)
        logger.debug("preempted on worker %d after %d output tokens (%d rounds in flight)", self.index,
                     request.num_output_tokens, request.num_inflight_rounds,
                     extra={"request_id": request.request_id})
        if request.num_inflight_rounds > 0:
            self.draining[request.request_id] = request
        else:
            self.waiting.push(request)

    def finish(self, request: Request, reason: StopReason | None) -> None:
        """Remove the request from every structure and free its blocks (errors: reason None)."""
        status = request.status
        if status is RequestStatus.FINISHED:
            return
        if self.pooling_inflight.pop(request.request_id, None) is not None:
            pass
        elif status is RequestStatus.RUNNING:
            self.running.remove(request)
            if self.kv is not None:
                self.kv.free(request)
            if self.encoder is not None:
                self.encoder.release_request(request)
        else:
            if not self.waiting.remove(request.request_id):
                self.held.remove(request.request_id)
            self.draining.pop(request.request_id, None)
        self.release_held(request)
        if reason is StopReason.ABORTED and request.is_on_worker and self.kv is not None:
            self.pending_abort_ids.append(request.request_id)
        self._forget_on_worker(request)
        request.status = RequestStatus.FINISHED
        request.stop_reason = reason
        del self.requests[request.request_id]
        self.observer.on_finished(request, reason, self.index)
        logger.debug("finished on worker %d: %s, %d output tokens", self.index,
                     reason.name if reason is not None else "error", request.num_output_tokens,
                     extra={"request_id": request.request_id})

    def evict_all(self) -> list[Request]:
        """The worker is gone: take every request off it (its blocks, cache and rounds went with it).

        The KV pool starts empty, as the worker will when it rejoins.
        """
        requests = list(self.requests.values())
        for request in requests:
            request.reset_for_recompute()
        self.requests.clear()
        self.running.clear()
        self.waiting = WaitingQueue()
        self.draining.clear()
        self.held = HeldSamples()
        self.pooling_inflight.clear()
        self.inflight.clear()
        self.pending_finished_ids.clear()
        self.pending_abort_ids.clear()
        self.rounds_since_admission = 0
        self.next_round_id = 0  # a new Execute stream numbers its rounds from 0
        if self.kv is not None:
            self.kv = KVBlockManager(self.info.num_kv_blocks, self.info.block_size, self.kv.enable_prefix_caching)
        if self.encoder_budget is not None:
            self.encoder = EncoderCacheManager(self.encoder_budget)
        return requests

    def round_done(self, rnd: InflightRound) -> None:
        """The round's last step came back: requests preempted meanwhile may queue again."""
        for entry in rnd.entries:
            request = entry.request
            request.num_inflight_rounds -= 1
            if request.num_inflight_rounds == 0 and request.request_id in self.draining:
                del self.draining[request.request_id]
                self.waiting.push(request)

    def take_abort_ids(self) -> list[str]:
        ids, self.pending_abort_ids = self.pending_abort_ids, []
        return ids

    def take_finished_ids(self) -> list[str]:
        ids, self.pending_finished_ids = self.pending_finished_ids, []
        return ids

    def _forget_on_worker(self, request: Request) -> None:
        if request.is_on_worker:
            request.is_on_worker = False
            self.pending_finished_ids.append(request.request_id)
