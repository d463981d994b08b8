"""`choose_num_steps`: how many forward passes the next round of one worker runs.

Policy (multi-step, RFC 6854 taken further: it works together with chunked prefill):
  * 1 step while a prefill is chunked or admissions are pending: a running request is
    mid-prefill, or the waiting queue's prompts cannot all be prefilled within this round's
    token budget. Each chunk then follows the last, and each admission the one before it,
    without waiting n steps. (Testing only the head admitted one prompt per n-step round
    while the queue was longer than a step's budget; at 64 streams the queue grew and the
    batch shrank.)
  * otherwise n = num_scheduler_steps (more while the worker's steps are short: `round_steps`;
    a request near the end of a full pool may then be preempted to make room for the lookahead
    of the others' longer round), and the waiting requests, whole prompts that fit the
    budget, are admitted into step 0 of that round: they prefill, sample, and decode in steps
    1..n-1 like everyone else. A new request therefore waits at most for the rounds already
    in flight (max_inflight_rounds x n steps) before its first token, so TTFT stays bounded
    by n, while the batch keeps decoding n steps per round trip under steady arrivals.
  * n is cut to the largest number of tokens any request still wants (no round of 8 steps
    for requests that want 2 more tokens), and to the context room of the request closest
    to max_model_len (a step never computes a position >= max_model_len).
Tokens a request samples after its stop inside a round are discarded by the output
processor; its lookahead blocks are freed with the request.
"""

from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.worker_state import WorkerState


def is_certain_to_finish(request: Request, max_model_len: int) -> bool:
    """True when rounds in flight already sample the request's last token: don't schedule it."""
    num_inflight = request.num_inflight_tokens
    return (request.num_output_tokens + num_inflight >= request.sampling.max_tokens
            or request.num_tokens + num_inflight >= max_model_len)


def is_prefilling(request: Request) -> bool:
    """Tokens it knows are still to be computed before it samples again (a prompt, or a
    recompute after preemption): the next step is a chunk, not a decode."""
    return request.num_computed_tokens < request.num_optimistic_tokens - 1


def can_admit_now(ws: WorkerState, max_num_seqs: int, enable_priority_preemption: bool) -> bool:
    """Whether the head of the waiting queue could get a sequence slot and a block this round."""
    if not ws.waiting or ws.kv is None:
        return False
    if len(ws.running) < max_num_seqs and ws.kv.num_free_blocks > 0:
        return True
    return (enable_priority_preemption and bool(ws.running)
            and ws.running[-1].priority < ws.waiting.peek().priority)


def round_steps(ws: WorkerState, config: SchedulerConfig) -> int:
    """The steps a decode round of this worker may run: num_scheduler_steps, or more while its steps
    are short, as many as take config.round_target_ms by its measured step time, up to
    max_scheduler_steps.

    Why: each round costs a fixed hand-over, the worker's last step of a round and the start of
    the next running beside the scheduler's and the worker's round bookkeeping. At one stream of
    the small model (steps of ~1 ms, 2-core AMD EPYC Zen 4) the last two inter-token gaps of an
    8-step round were 0.2 and 0.35 ms over the others', and served, paired
    (`python -m benchmarks.paired --workload completion --model small`): 16 steps a round
    against 8 took 5.6 % less time a request, 32 against 16 1.8 % less. Where a step takes
    longer than round_target_ms / num_scheduler_steps (the medium model, or 64 streams of the
    small one) nothing changes, so a request arriving mid-round still waits at most
    max(num_scheduler_steps steps, round_target_ms) per round in flight.
    """
    n = config.num_scheduler_steps
    if n == 1 or config.round_target_ms <= 0 or not ws.step_s:
        return n
    return max(n, min(config.max_scheduler_steps, int(config.round_target_ms / 1000 / ws.step_s)))


def choose_num_steps(ws: WorkerState, num_scheduler_steps: int, max_num_seqs: int, token_budget: int,
                     max_model_len: int, enable_priority_preemption: bool = False) -> int:
    if num_scheduler_steps == 1 or ws.kv is None:
        return 1
    wanted = 1
    room = num_scheduler_steps
    for request in ws.running:
        if is_certain_to_finish(request, max_model_len):
            continue
        if is_prefilling(request):
            return 1  # mid-prefill
        num_known = request.num_optimistic_tokens
        remaining = request.sampling.max_tokens - request.num_output_tokens - request.num_inflight_tokens
        if remaining > wanted:
            wanted = remaining
        # This round computes positions num_known-1 .. num_known+n-2; keep them < max_model_len.
        room = min(room, max_model_len - num_known + 1)
    if can_admit_now(ws, max_num_seqs, enable_priority_preemption):
        head = ws.waiting.peek()
        # Decodes take one token each from the budget; the rest is for whole prefills.
        if ws.waiting.num_tokens > token_budget - len(ws.running):
            return 1  # the queue outlasts step 0: admit (and chunk) every step until it is in
        wanted = max(wanted, head.sampling.max_tokens - head.num_output_tokens)
        room = min(room, max_model_len - head.num_tokens + 1)
    return max(1, min(num_scheduler_steps, wanted, room))
