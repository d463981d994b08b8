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

from worker_harness import make_runner, run_round

from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import UpdateSink
from services.worker.model_runner import ModelRunner
from shared.execute import StepOutput, WorkerInfo
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


def _serve(
    runner: ModelRunner, requests: list[Request], num_steps: int, aborts: dict[str, int] | None = None
) -> dict[str, list[int]]:
    """Tokens streamed per request; `aborts`: request id -> the number of rounds sent before its abort."""
    config = SchedulerConfig(num_scheduler_steps=num_steps, max_inflight_rounds=2, pipeline_quiet_rounds=0)
    scheduler = Scheduler(config, [_info(runner)])
    streamed: dict[str, list[int]] = {r.request_id: [] for r in requests}
    sink = UpdateSink()
    for request in requests:
        scheduler.add_request(request, sink)
    inflight: deque[list[StepOutput]] = deque()
    num_rounds = 0
    while scheduler.requests or inflight:
        while rounds := scheduler.schedule():
            inflight.extend(run_round(runner, rnd) for rnd in rounds.values())
            num_rounds += 1
            for request_id, when in (aborts or {}).items():
                if when == num_rounds:
                    scheduler.abort_request(request_id, sink)
        for output in inflight.popleft():
            scheduler.update_from_output(0, output, sink)
        for updates in sink.by_connection.values():
            for update in updates:
                streamed[update.request_id].extend(update.token_ids)
        sink = UpdateSink()
    kv = scheduler.workers[0].kv
    assert kv is not None
    kv.check_invariants()
    assert kv.num_free_blocks == NUM_BLOCKS
    return streamed


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
    )
    alone = {
        r.request_id: _serve(make_runner(llama_dir), [r], num_steps=1)[r.request_id]
        for r in _requests(0, base, prompts)
    }
    runner = make_runner(llama_dir)
    advance = runner.input_builder.advance
    narrowed: list[int] = []

    def counting_advance(prev, sampled, keep=None):  # type: ignore[no-untyped-def]
        narrowed.append(keep is not None)
        return advance(prev, sampled, keep)

    runner.input_builder.advance = counting_advance  # type: ignore[method-assign]
    aborts = {"r2": 2, "r5": 3, "r9": 5}
    together = _serve(runner, _requests(0, base, prompts), num_steps=8, aborts=aborts)
    assert sum(narrowed) >= 3, "rows were meant to finish mid-round"
    for request_id, tokens in together.items():
        if request_id in aborts:
            assert tokens == alone[request_id][: len(tokens)]
        else:
            assert tokens == alone[request_id], request_id
