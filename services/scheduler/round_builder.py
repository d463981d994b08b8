"""`RoundBuilder`: plans one `ExecuteRound` for one worker (chunked prefill, preemption).

Running requests first (decodes and unfinished prefill chunks, in running order), then
waiting ones, until the token budget, the sequence limit or the KV pool runs out. Request
counters change only in `_finalize`, once the round is fixed, so a request taken out of the
round again (priority preemption) needs no undo beyond freeing its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.config import MIN_STEP_TOKENS_WHILE_DECODING, SchedulerConfig
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.multi_step import choose_num_steps, is_certain_to_finish, is_prefilling, round_steps
from services.scheduler.request import Request, RequestStatus
from services.scheduler.worker_state import InflightEntry, InflightRound, WorkerState
from shared.execute import CachedRequestData, ExecuteRound, NewRequestData


@dataclass(slots=True)
class _Entry:
    request: Request
    num_tokens: int  # step-0 tokens
    new_block_ids: list[int]  # blocks appended this round (all blocks for a new request)
    is_new: bool
    samples: bool


class RoundBuilder:
    """Builds rounds for the generate path; stateless between calls."""

    def __init__(self, config: SchedulerConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def build(self, ws: WorkerState) -> ExecuteRound | None:
        """The next round for `ws`, or None when there is nothing to run."""
        assert ws.kv is not None
        plan = _Plan(self, ws, ws.kv)
        plan.schedule_running()
        plan.schedule_waiting()
        return plan.finalize()


def step_token_budget(ws: WorkerState, config: SchedulerConfig, max_model_len: int) -> int:
    """Tokens step 0 of the next round may compute: fewer while requests decode.

    A step's time grows with its tokens on a CPU, so a step that prefills 2,048 prompt tokens
    beside 16 decodes stalls those 16 streams for ~100 decode steps' worth of time. While
    requests decode, the step is held to S x max_step_tokens_per_decode tokens (at least
    MIN_STEP_TOKENS_WHILE_DECODING), S the streams decoding now plus those waiting (at most
    max_num_seqs): every step still gives each stream its token, and an inter-token gap stays
    within about that factor of a decode step of the batch the worker runs once the queue is
    in, which is what sets the median gap. Sized by the decoding streams alone, a burst's
    first admissions held every later step to 3 tokens per stream already in: 16 streams let
    48 tokens of prompt through per step, so the other 48 of a 64-request burst took ~90
    one-step rounds to get in, and the batch ran small meanwhile (measured only together with
    multi_step's queue rule: small model, 64 streams, +5-12 % output tokens/s, inter-token
    p99 still about 2.2x p50). Only a waiting
    queue or a chunked prefill makes the cap matter, so the count is skipped otherwise.
    """
    budget = config.max_num_batched_tokens
    per_decode = config.max_step_tokens_per_decode
    if not per_decode or not ws.running:
        return budget
    num_decoding = 0
    prefill_pending = bool(ws.waiting)
    for request in ws.running:
        if is_certain_to_finish(request, max_model_len):
            continue
        if is_prefilling(request):
            prefill_pending = True
        else:
            num_decoding += 1
    if not num_decoding or not prefill_pending:
        return budget
    num_streams = min(num_decoding + len(ws.waiting), config.max_num_seqs)
    return min(budget, max(num_streams * per_decode, MIN_STEP_TOKENS_WHILE_DECODING))


class _Plan:
    """One round under construction."""

    def __init__(self, builder: RoundBuilder, ws: WorkerState, kv: KVBlockManager) -> None:
        config = builder.config
        self.ws = ws
        self.kv = kv
        self.config = config
        self.max_model_len = builder.max_model_len
        self.budget = step_token_budget(ws, config, builder.max_model_len)
        self.num_steps = choose_num_steps(ws, round_steps(ws, config), config.max_num_seqs,
                                          self.budget, builder.max_model_len,
                                          config.enable_priority_preemption)
        self.entries: dict[str, _Entry] = {}
        self.preempted = False
        self.encoder = ws.encoder
        self.encoder_round = ws.encoder.begin_round() if ws.encoder is not None else None

    def _fit_encoder(self, request: Request, start: int, num_tokens: int) -> int:
        """Tokens of the chunk whose images fit the encoder budget (the chunk, for text-only requests)."""
        if self.encoder is None or self.encoder_round is None or not request.mm_items:
            return num_tokens
        return self.encoder.fit(self.encoder_round, request, start, num_tokens)

    def _undo_encoder(self, request: Request) -> None:
        if self.encoder_round is not None:
            self.encoder_round.undo(request.request_id)

    def schedule_running(self) -> None:
        kv, ws, entries = self.kv, self.ws, self.entries
        max_model_len = self.max_model_len
        for request in list(ws.running):
            if self.budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_inflight = request.num_inflight_tokens
            num_known = len(request.all_token_ids) + num_inflight
            if (num_known >= max_model_len  # inlined is_certain_to_finish: this loop is the hot path
                    or len(request.output_token_ids) + num_inflight >= request.sampling.max_tokens):
                continue
            remaining = num_known - request.num_computed_tokens
            assert remaining >= 1, f"{request.request_id}: nothing left to compute"
            num_tokens = remaining if remaining <= self.budget else self.budget
            if request.mm_items and (num_tokens := self._fit_encoder(
                    request, request.num_computed_tokens, num_tokens)) == 0:
                continue  # its next image fits the encoder budget in a later round
            samples = num_tokens == remaining
            lookahead = self.num_steps - 1 if samples else 0
            while (new_blocks := kv.allocate_slots(request, num_tokens, lookahead)) is None:
                victim = ws.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if new_blocks is not None:
                entries[request.request_id] = _Entry(request, num_tokens, new_blocks, False, samples)
                self.budget -= num_tokens

    def schedule_waiting(self) -> None:
        if self.preempted:
            return  # blocks are short: let running requests go first
        kv, ws, config = self.kv, self.ws, self.config
        multi_step = self.num_steps > 1
        while ws.waiting and self.budget > 0:
            request = ws.waiting.peek()
            if len(ws.running) >= config.max_num_seqs and not self._preempt_lower(request):
                return
            if multi_step and request.num_tokens + self.num_steps - 1 > self.max_model_len:
                return  # its lookahead would pass the context: it goes in a shorter round
            while True:
                self._undo_encoder(request)  # a retry plans its images again
                computed, num_hit = kv.get_computed_blocks(request)
                remaining = request.num_tokens - num_hit
                if multi_step and remaining > self.budget:
                    return  # multi-step rounds admit whole prefills only; chunks run in 1-step rounds
                num_tokens = min(remaining, self.budget)
                fitted = self._fit_encoder(request, num_hit, num_tokens)
                if fitted == 0 or (multi_step and fitted < remaining):
                    self._undo_encoder(request)
                    return  # its image waits for encoder budget (never a zero or negative chunk)
                num_tokens = fitted
                samples = num_tokens == remaining
                lookahead = self.num_steps - 1 if samples else 0
                blocks = kv.allocate_slots(request, num_tokens, lookahead, computed)
                if blocks is not None or not self._preempt_lower(request):
                    break
            if blocks is None:
                self._undo_encoder(request)
                return
            ws.waiting.pop()
            ws.admit(request, num_hit)
            self._add(_Entry(request, num_tokens, blocks, True, samples))

    def _preempt_lower(self, request: Request) -> bool:
        """Priority preemption: evict the last running request if its priority is lower."""
        running = self.ws.running
        if not (self.config.enable_priority_preemption and running
                and running[-1].priority < request.priority):
            return False
        self._preempt(running[-1])
        return True

    def _preempt(self, victim: Request) -> None:
        entry = self.entries.pop(victim.request_id, None)
        # Victims are last in running order, and requests admitted this round have at least
        # the waiting head's priority, so a victim is never one this round admitted.
        assert entry is None or not entry.is_new
        if entry is not None:
            self.budget += entry.num_tokens
        self._undo_encoder(victim)
        self.ws.preempt(victim)
        self.preempted = True

    def _add(self, entry: _Entry) -> None:
        self.entries[entry.request.request_id] = entry
        self.budget -= entry.num_tokens

    def finalize(self) -> ExecuteRound | None:
        ws = self.ws
        if not self.entries:
            return None
        entries = [e for e in self.entries.values() if e.is_new]
        entries += [e for e in self.entries.values() if not e.is_new]
        num_steps = self.num_steps
        rnd = ExecuteRound(round_id=ws.next_round_id, num_steps=num_steps)
        record = InflightRound(rnd.round_id, num_steps)
        sampler_ids, samplers = record.sampler_ids, record.samplers
        cached = rnd.cached_requests = CachedRequestData()
        encoder = self.encoder
        if encoder is not None and self.encoder_round is not None:
            # Commit before taking frees: an entry revived this round must not be freed.
            rnd.encoder_hashes = encoder.commit(self.encoder_round)
            rnd.encoder_free_hashes = encoder.take_frees()
        for e in entries:
            request = e.request
            start = request.num_computed_tokens
            if e.is_new:
                rnd.new_requests.append(NewRequestData(
                    request_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_computed_tokens=start,
                    block_ids=list(e.new_block_ids),
                    sampling=request.sampling,
                    traceparent=request.span_traceparent or request.traceparent,
                    mm_items=list(request.mm_items),
                ))
                request.is_on_worker = True
            else:
                cached.request_ids.append(request.request_id)
                cached.new_block_ids.append(e.new_block_ids)
            rnd.num_scheduled_tokens.append(e.num_tokens)
            step0_end = start + e.num_tokens
            if encoder is not None and request.mm_items and start < request.mm_items[-1].end:
                encoder.release_passed(request, step0_end)  # freed with the next round, after this one
            if e.samples:
                sampler_ids.append(request.request_id)
                samplers.append(request)
                request.num_computed_tokens = step0_end + num_steps - 1
                request.num_inflight_tokens += num_steps
            else:
                request.num_computed_tokens = step0_end
            request.num_inflight_rounds += 1
            record.entries.append(InflightEntry(request, step0_end, e.samples))
        ws.rounds_since_admission = 0 if rnd.new_requests else ws.rounds_since_admission + 1
        rnd.finished_request_ids = ws.take_finished_ids()
        ws.next_round_id += 1
        ws.num_rounds += 1
        ws.inflight.append(record)
        return rnd
