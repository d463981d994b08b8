"""The real scheduler drives the runner in-process, so leaving finished rows out of a round is
checked against what the scheduler expects: it accepts every step (ProtocolError otherwise),
frees every block, and each request streams the tokens it streams when it runs alone.

Rounds are pipelined as over the Execute stream: the next round is built, and run (the worker
runs rounds in order), before the previous round's steps are applied. So a round often carries
a request that the round before already finished, and some requests are aborted while rounds
that carry them are in flight.
"""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import numpy as np
from worker_harness import make_runner

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import UpdateSink
from services.worker.model_runner import ModelRunner
from services.worker.step_output import SampledStep
from shared.execute import ExecuteRound, WorkerInfo
from shared.sampling import SamplingOptions
from shared.types import RequestKind

NUM_BLOCKS = 128


def _info(runner: ModelRunner) -> WorkerInfo:
    return WorkerInfo(
        model_id="tiny",
        task=RequestKind.GENERATE,
        vocab_size=runner.vocab_size,
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        num_kv_blocks=NUM_BLOCKS,
        eos_token_ids=runner.eos_token_ids,
        attention_backend="sdpa",
        dtype="float32",
        device="cpu",
    )


class _Served:
    """What a run streamed, and how much the worker computed for each request."""

    def __init__(self, requests: list[Request]) -> None:
        self.tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        self.row_steps: dict[str, int] = dict.fromkeys(self.tokens, 0)  # forward passes that included it
        self.after_abort: dict[str, int] = {}  # of those, the ones after its abort reached the scheduler


def _count_row_steps(runner: ModelRunner, served: _Served) -> None:
    """Count, per request, the forward passes (step 0 chunks, decode steps, resumed step 0s) that compute it."""
    builder, states = runner.input_builder, runner.states
    build, advance, resume = builder.build, builder.advance, builder.resume

    def count(rows: np.ndarray) -> None:
        for row in rows.tolist():
            request_id = states.request_ids[row] or ""
            served.row_steps[request_id] += 1
            if request_id in served.after_abort:
                served.after_abort[request_id] += 1

    def counting_build(rows, num_scheduled):  # type: ignore[no-untyped-def]
        count(rows)
        return build(rows, num_scheduled)

    def counting_advance(prev, sampled, keep=None):  # type: ignore[no-untyped-def]
        inputs = advance(prev, sampled, keep)
        count(inputs.sample_rows)
        return inputs

    def counting_resume(prev, sampled, rows, num_scheduled):  # type: ignore[no-untyped-def]
        inputs = resume(prev, sampled, rows, num_scheduled)
        if inputs is not None:
            count(inputs.sample_rows)
        return inputs

    builder.build = counting_build  # type: ignore[method-assign]
    builder.advance = counting_advance  # type: ignore[method-assign]
    builder.resume = counting_resume  # type: ignore[method-assign]


def _serve(
    runner: ModelRunner,
    requests: list[Request],
    num_steps: int,
    aborts: dict[str, tuple[int, int]] | None = None,
    tell_worker: bool = True,
    max_num_batched_tokens: int = 2048,
) -> _Served:
    """Serve `requests` through the real scheduler and `runner`, as over the Execute stream.

    Rounds go out as the scheduler builds them (up to two in flight) and the worker runs them in
    order, so while one runs, the next is already queued. `aborts`: request id -> (round id,
    step index) right after which its abort reaches the scheduler, in the middle of that round;
    the scheduler's `AbortRows` reach the runner at once unless `tell_worker` is False (as
    before aborts were sent: the worker learns it from a later round's finished ids).
    """
    config = SchedulerConfig(num_scheduler_steps=num_steps, max_inflight_rounds=2, pipeline_quiet_rounds=0,
                             max_num_batched_tokens=max_num_batched_tokens)
    scheduler = Scheduler(config, [_info(runner)])
    served = _Served(requests)
    _count_row_steps(runner, served)
    sink = UpdateSink()
    for request in requests:
        scheduler.add_request(request, sink)
    queued: deque[ExecuteRound] = deque()
    due = {when: request_id for request_id, when in (aborts or {}).items()}

    def on_step(step: SampledStep) -> None:
        steps.append(step)
        request_id = due.pop((step.round_id, step.step_index), None)
        if request_id is not None and scheduler.abort_request(request_id, sink):
            served.after_abort[request_id] = 0
            for ids in scheduler.take_aborts().values():
                if tell_worker:
                    runner.abort(ids)

    while scheduler.requests or queued:
        while rounds := scheduler.schedule():
            queued.extend(rounds.values())
        steps: list[SampledStep] = []
        runner.execute_round(queued.popleft(), on_step)
        for step in steps:
            scheduler.update_from_output(0, step.to_step_output(), sink)
        for updates in sink.by_connection.values():
            for update in updates:
                served.tokens[update.request_id].extend(update.token_ids)
        sink = UpdateSink()
    assert not due, f"aborts never reached: {due}"
    kv = scheduler.workers[0].kv
    assert kv is not None
    kv.check_invariants()
    assert kv.num_free_blocks == NUM_BLOCKS
    return served


def _requests(seed: int, base: dict[str, list[int]], prompts: dict[str, list[int]]) -> list[Request]:
    """Varied stops: max_tokens, a stop id the request is bound to meet, min_tokens, logprobs."""
    rng = random.Random(seed)
    out = []
    for request_id, prompt in prompts.items():
        stops = (base[request_id][rng.randrange(1, 12)],) if rng.random() < 0.6 else ()
        sampling = SamplingOptions(
            temperature=0.0,
            max_tokens=rng.randint(1, 20),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=stops,
            ignore_eos=rng.random() < 0.3,
            logprobs=rng.choice([None, 2]),
        )
        out.append(Request(request_id, list(prompt), sampling))
    return out


def test_rows_leaving_rounds_keep_the_scheduler_consistent(llama_dir: Path) -> None:
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(4, 512) for _ in range(rng.randint(3, 30))] for i in range(14)}
    base = _serve(
        make_runner(llama_dir),
        [Request(i, list(p), SamplingOptions(temperature=0.0, max_tokens=20, ignore_eos=True))
         for i, p in prompts.items()],
        num_steps=1,
    ).tokens
    alone = {
        r.request_id: _serve(make_runner(llama_dir), [r], num_steps=1).tokens[r.request_id]
        for r in _requests(0, base, prompts)
    }
    runner = make_runner(llama_dir)
    advance = runner.input_builder.advance
    narrowed: list[int] = []

    def counting_advance(prev, sampled, keep=None):  # type: ignore[no-untyped-def]
        narrowed.append(keep is not None)
        return advance(prev, sampled, keep)

    runner.input_builder.advance = counting_advance  # type: ignore[method-assign]
    aborts = {"r2": (0, 7), "r5": (1, 3), "r9": (2, 0)}
    together = _serve(runner, _requests(0, base, prompts), num_steps=8, aborts=aborts).tokens
    assert sum(narrowed) >= 3, "rows were meant to finish mid-round"
    for request_id, tokens in together.items():
        if request_id in aborts:
            assert tokens == alone[request_id][: len(tokens)]
        else:
            assert tokens == alone[request_id], request_id


def test_an_abort_mid_round_stops_computing_the_row(llama_dir: Path) -> None:
    """Aborts reach the worker while the round computes: the row leaves its later steps and the
    round queued behind it; a prompt aborted between chunks is not computed further either."""
    rng = random.Random(5)
    sampling = SamplingOptions(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = {f"r{i}": [rng.randrange(4, 512) for _ in range(rng.randint(5, 20))] for i in range(6)}
    prompts["long"] = [rng.randrange(4, 512) for _ in range(150)]  # chunked over rounds 1-3 (1-step rounds)

    def requests() -> list[Request]:
        return [Request(i, list(p), sampling) for i, p in prompts.items()]

    # r1 mid-round (round 4 step 2: round 5 is queued), r3 at a round's last step (round 4 is
    # queued), `long` after its first chunk (its next chunk is queued). Same requests, same abort
    # points, the worker told or not: the scheduler builds the same rounds either way.
    aborts = {"r1": (4, 2), "r3": (3, 7), "long": (1, 0)}
    told = _serve(make_runner(llama_dir), requests(), 8, aborts, max_num_batched_tokens=64)
    untold = _serve(make_runner(llama_dir), requests(), 8, aborts, tell_worker=False, max_num_batched_tokens=64)
    plain = _serve(make_runner(llama_dir), requests(), 8, max_num_batched_tokens=64)

    assert told.after_abort == dict.fromkeys(aborts, 0), told.after_abort
    assert all(untold.after_abort[r] > 0 for r in aborts), untold.after_abort
    assert untold.after_abort["r1"] >= 5 + 1  # the rest of its round, and the queued one
    assert sum(told.row_steps.values()) < sum(untold.row_steps.values())
    assert told.tokens == untold.tokens  # the scheduler streams the same either way
    for request_id, tokens in told.tokens.items():
        if request_id in aborts:
            assert tokens == plain.tokens[request_id][: len(tokens)]
            assert len(tokens) < len(plain.tokens[request_id])
        else:
            assert tokens == plain.tokens[request_id], request_id
            assert told.row_steps[request_id] == plain.row_steps[request_id]
