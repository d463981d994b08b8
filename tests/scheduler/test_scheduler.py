"""Scheduler policy, one behaviour per test, against in-process fake workers."""

from __future__ import annotations

import json
from dataclasses import replace

from services.scheduler.config import MIN_STEP_TOKENS_WHILE_DECODING, SchedulerConfig
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import RequestUpdate, UpdateSink
from shared.errors import ErrorKind
from shared.execute import ExecuteRound
from shared.grammar import Grammar, GrammarKind
from shared.sampling import SamplingOptions
from shared.types import RequestKind, StopReason
from tests.scheduler.fake_worker import EOS_TOKEN_ID, FakeWorker, reference_output

NEVER_EOS = 10**9  # eos_period that (practically) never samples EOS


def _make(num_blocks: int = 64, block_size: int = 4, num_workers: int = 1, eos_period: int = NEVER_EOS,
          max_model_len: int = 256, **config: object) -> tuple[Scheduler, list[FakeWorker]]:
    workers = [FakeWorker(num_blocks, block_size, eos_period=eos_period, max_model_len=max_model_len)
               for _ in range(num_workers)]
    config.setdefault("num_scheduler_steps", 1)  # single-step unless a test is about multi-step
    return Scheduler(SchedulerConfig(**config), [w.info for w in workers]), workers  # type: ignore[arg-type]


def _req(request_id: str, prompt: list[int], max_tokens: int = 8, priority: int = 0, **sampling: object) -> Request:
    return Request(request_id=request_id, prompt_token_ids=prompt, priority=priority,
                   sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens, **sampling))  # type: ignore[arg-type]


def sched_sampling(max_tokens: int) -> SamplingOptions:
    return SamplingOptions(temperature=0.0, max_tokens=max_tokens)


def _updates(sink: UpdateSink) -> list[RequestUpdate]:
    return [u for batch in sink.by_connection.values() for u in batch]


def _run_until_done(sched: Scheduler, workers: list[FakeWorker], limit: int = 500) -> dict[str, list[int]]:
    """Schedule and run whole rounds until no request is left; returns tokens per request."""
    tokens: dict[str, list[int]] = {}
    for _ in range(limit):
        if not sched.requests:
            return tokens
        for index, rnd in sched.schedule().items():
            workers[index].submit(rnd)
        for index, worker in enumerate(workers):
            while worker.has_work:
                sink = UpdateSink()
                sched.update_from_output(index, worker.step(), sink)
                for u in _updates(sink):
                    tokens.setdefault(u.request_id, []).extend(u.token_ids)
    raise AssertionError("requests did not finish")


def test_rejects_request_that_can_never_fit_in_one_worker() -> None:
    sched, _ = _make(num_blocks=8, block_size=4)  # 32 tokens per worker
    sink = UpdateSink()
    sched.add_request(_req("big", list(range(4, 24)), max_tokens=20), sink)
    [update] = _updates(sink)
    assert update.error is not None and update.error.kind is ErrorKind.INVALID_ARGUMENT
    assert "32" in update.error.message
    assert not sched.requests and not sched.schedule()


def test_rejects_invalid_requests_with_clear_errors() -> None:
    sched, _ = _make()
    sink = UpdateSink()
    sched.add_request(_req("empty", []), sink)
    sched.add_request(_req("zero", [5], max_tokens=0), sink)
    sched.add_request(Request("embed", [5, 6], kind=RequestKind.EMBED), sink)
    sched.add_request(_req("long", [5] * 300), sink)
    sched.add_request(_req("ok", [5]), sink)
    sched.add_request(_req("ok", [6]), sink)
    messages = {u.request_id: u.error.message for u in _updates(sink) if u.error}
    assert set(messages) == {"empty", "zero", "embed", "long", "ok"}
    assert "already in use" in messages["ok"] and "embed" in messages["embed"]
    assert list(sched.requests) == ["ok"]


def test_higher_priority_waits_less() -> None:
    sched, _ = _make(max_num_seqs=1)
    sink = UpdateSink()
    sched.add_request(_req("low", [5, 6], priority=0), sink)
    sched.add_request(_req("high", [7, 8], priority=5), sink)
    rnd = sched.schedule()[0]
    assert [n.request_id for n in rnd.new_requests] == ["high"]


def test_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    sched, [worker] = _make(max_num_batched_tokens=16)
    sink = UpdateSink()
    sched.add_request(_req("short", [5, 6, 7], max_tokens=20), sink)
    worker.submit(sched.schedule()[0])
    for out in worker.run_round():
        sched.update_from_output(0, out, sink)
    sched.add_request(_req("long", list(range(4, 44))), sink)
    chunks = []
    for _ in range(3):
        rnd = sched.schedule()[0]
        chunks.append(rnd.num_scheduled_tokens)
        assert sum(rnd.num_scheduled_tokens) <= 16
        worker.submit(rnd)
        for out in worker.run_round():
            sched.update_from_output(0, out, sink)
    # decode of "short" (1 token) + a 15-token chunk, twice, then the last 10 prompt tokens.
    assert chunks == [[15, 1], [1, 15], [1, 10]]


def test_priority_preemption_evicts_lower_priority_running_request() -> None:
    for enabled in (False, True):
        sched, [worker] = _make(num_blocks=6, block_size=4, enable_priority_preemption=enabled)
        sink = UpdateSink()
        sched.add_request(_req("low", list(range(4, 20)), max_tokens=8), sink)  # 4 blocks + 1 to decode
        worker.submit(sched.schedule()[0])
        for out in worker.run_round():
            sched.update_from_output(0, out, sink)
        sched.add_request(_req("high", list(range(30, 42)), max_tokens=4, priority=1), sink)
        rnd = sched.schedule()[0]
        admitted = [n.request_id for n in rnd.new_requests]
        if enabled:
            assert admitted == ["high"] and rnd.finished_request_ids == ["low"]
            assert sched.requests["low"].status is RequestStatus.PREEMPTED
        else:
            assert admitted == [] and sched.requests["low"].status is RequestStatus.RUNNING


def test_preempted_request_resumes_with_same_tokens() -> None:
    sched, workers = _make(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    sink = UpdateSink()
    prompts = {f"r{i}": [4 + i] * 9 + list(range(10 + i, 14 + i)) for i in range(4)}
    for request_id, prompt in prompts.items():
        sched.add_request(_req(request_id, prompt, max_tokens=12), sink)
    tokens = _run_until_done(sched, workers)
    assert sched.stats().num_preemptions > 0
    for request_id, prompt in prompts.items():
        expected = reference_output(prompt, sched_sampling(12), 256, 64, NEVER_EOS)
        assert tokens[request_id] == expected


def test_identical_block_aligned_requests_do_not_crash_and_match() -> None:
    """Regression for vLLM PR 11895: the second identical request recomputes the last block."""
    sched, [worker] = _make(block_size=4)
    sink = UpdateSink()
    prompt = list(range(4, 20))  # 16 tokens, 4 full blocks
    sched.add_request(_req("a", prompt), sink)
    worker.submit(sched.schedule()[0])
    for out in worker.run_round():
        sched.update_from_output(0, out, sink)
    sched.add_request(_req("b", prompt), sink)
    rnd = sched.schedule()[0]
    [new] = rnd.new_requests
    assert new.num_computed_tokens == 12 and rnd.num_scheduled_tokens[0] == 4
    worker.submit(rnd)
    tokens = _run_until_done(sched, [worker])
    assert tokens["b"] == reference_output(prompt, sched_sampling(8), 256, 64, NEVER_EOS)


def _run_all(sched: Scheduler, worker: FakeWorker, sink: UpdateSink, *rounds: ExecuteRound) -> None:
    for rnd in rounds:
        worker.submit(rnd)
    for _ in rounds:
        for out in worker.run_round():
            sched.update_from_output(0, out, sink)


def test_multi_step_round_goes_ahead_just_in_time_while_requests_arrive() -> None:
    """Not quiet (a request was just admitted): the next n-step round is built once the round in
    flight will end within pipeline_lead_ms by the worker's step time, measured between its
    outputs' sampling times; with steps longer than that (or no lead), only once it is back."""
    for step_ms, lead_ms, built_after in ((2, 5, 6), (1, 5, 3), (2, 0, 8), (6, 5, 8)):
        sched, [worker] = _make(num_scheduler_steps=8, pipeline_lead_ms=lead_ms, round_target_ms=0)
        sink = UpdateSink()
        sched.add_request(_req("a", [5, 6, 7], max_tokens=100), sink)
        first = sched.schedule()[0]
        worker.submit(first)
        outputs = worker.run_round()
        second = None
        for fed, out in enumerate(outputs, start=1):
            sched.update_from_output(0, replace(out, sampled_unix_ns=10**9 + fed * step_ms * 10**6), sink)
            second = sched.schedule().get(0)
            if second is not None:
                break
        assert second is not None and fed == built_after, f"{step_ms} ms steps, lead {lead_ms} ms: built after {fed}"
        assert second.num_steps == 8 and second.num_scheduled_tokens == [1], "a's next decode round"
        worker.submit(second)
        for out in outputs[fed:] + worker.run_round():  # the rest of the first round, then the second
            sched.update_from_output(0, out, sink)
        assert len(sched.requests["a"].output_token_ids) == 16


def _decode_round_after_steps_of(step_ms: float, **config: object) -> int:
    """The steps of a's second round, once its first round's steps came back `step_ms` apart."""
    sched, [worker] = _make(**{"num_scheduler_steps": 8, "pipeline_lead_ms": 0, **config})
    sink = UpdateSink()
    sched.add_request(_req("a", [5, 6, 7], max_tokens=200), sink)
    first = sched.schedule()[0]
    worker.submit(first)
    for fed, out in enumerate(worker.run_round(), start=1):
        sched.update_from_output(0, replace(out, sampled_unix_ns=10**9 + int(fed * step_ms * 10**6)), sink)
    return sched.schedule()[0].num_steps


def test_rounds_grow_past_num_scheduler_steps_while_steps_are_short() -> None:
    """As many steps as take round_target_ms by the measured step time, at least num_scheduler_steps and
    at most max_scheduler_steps; round_target_ms=0 keeps num_scheduler_steps."""
    assert _decode_round_after_steps_of(1.0) == 24  # the default 24 ms target
    assert _decode_round_after_steps_of(0.5) == 32  # capped
    assert _decode_round_after_steps_of(4.0) == 8  # long steps: num_scheduler_steps
    assert _decode_round_after_steps_of(1.0, round_target_ms=0) == 8
    assert _decode_round_after_steps_of(1.0, max_scheduler_steps=16) == 16
    assert _decode_round_after_steps_of(1.0, num_scheduler_steps=1) == 1


def test_a_burst_of_prefills_is_held_to_a_few_tokens_per_stream() -> None:
    """While streams decode, a step carries at most 3 tokens per stream decoding or waiting:
    the burst goes in over several steps, sized by the batch it makes, not the one before it."""
    sched, [worker] = _make(num_blocks=1024, max_num_batched_tokens=2048, max_num_seqs=256,
                            max_step_tokens_per_decode=3)
    sink = UpdateSink()
    for i in range(32):
        sched.add_request(_req(f"early{i}", [5 + i, 6, 7, 8], max_tokens=100), sink)
    _run_all(sched, worker, sink, sched.schedule()[0])  # 32 prefills in one step: nobody decodes yet
    for i in range(40):  # distinct first tokens: no prefix-cache hits
        sched.add_request(_req(f"burst{i}", [200 + i, *range(4, 103)], max_tokens=4), sink)
    steps: list[tuple[int, int]] = []  # (tokens, streams decoding or waiting) per step while the burst prefills
    while any(r.request_id.startswith("burst") and r.num_computed_tokens < 100 for r in sched.requests.values()):
        num_waiting = len(sched.workers[0].waiting)
        rnd = sched.schedule()[0]
        assert rnd.num_steps == 1, "admissions pending: every step admits"
        steps.append((sum(rnd.num_scheduled_tokens), rnd.num_scheduled_tokens.count(1) + num_waiting))
        _run_all(sched, worker, sink, rnd)
    assert steps[0] == (3 * 72, 72), "the budget is used in full while the burst waits"
    assert all(tokens <= 3 * streams for tokens, streams in steps), f"a step stalled the decoding streams: {steps}"
    assert len(steps) > 4000 // (3 * 72), "the 4,000 burst tokens went through in held steps (2 without the cap)"


def test_a_queue_longer_than_the_step_is_admitted_in_one_step_rounds() -> None:
    """Two prompts that each fit the budget but not together: a 1-step round takes one whole and
    the other's first chunk, rather than an n-step round that leaves the second waiting n steps."""
    sched, [worker] = _make(num_scheduler_steps=8, max_num_batched_tokens=16)
    sink = UpdateSink()
    sched.add_request(_req("a", [5, 6, 7], max_tokens=50), sink)
    _run_all(sched, worker, sink, sched.schedule()[0])
    sched.add_request(_req("b", list(range(10, 20)), max_tokens=50), sink)
    sched.add_request(_req("c", list(range(30, 40)), max_tokens=50), sink)
    rnd = sched.schedule()[0]
    assert rnd.num_steps == 1
    assert [n.request_id for n in rnd.new_requests] == ["b", "c"] and rnd.num_scheduled_tokens == [10, 5, 1]
    _run_all(sched, worker, sink, rnd)
    assert sched.schedule()[0].num_steps == 1, "c is mid-prefill"


def test_without_the_cap_a_burst_fills_the_step_budget() -> None:
    sched, [worker] = _make(num_blocks=1024, max_num_batched_tokens=2048, max_step_tokens_per_decode=0)
    sink = UpdateSink()
    sched.add_request(_req("early", [5, 6, 7, 8], max_tokens=100), sink)
    _run_all(sched, worker, sink, sched.schedule()[0])
    for i in range(40):
        sched.add_request(_req(f"burst{i}", list(range(4, 104)), max_tokens=4), sink)
    assert sum(sched.schedule()[0].num_scheduled_tokens) == 2048


def test_few_decoding_streams_still_let_a_prompt_through_in_chunks_of_the_floor() -> None:
    sched, [worker] = _make(num_blocks=1024, max_num_batched_tokens=2048, max_step_tokens_per_decode=3)
    sink = UpdateSink()
    sched.add_request(_req("early", [5, 6, 7, 8], max_tokens=100), sink)
    _run_all(sched, worker, sink, sched.schedule()[0])
    sched.add_request(_req("long", list(range(4, 204)), max_tokens=4), sink)
    floor = MIN_STEP_TOKENS_WHILE_DECODING
    assert sched.schedule()[0].num_scheduled_tokens == [floor - 1, 1], "2 streams: the floor, the decode included"


def test_a_dozen_decoding_streams_let_three_tokens_each_through_above_the_floor() -> None:
    """12 streams (11 decoding, 1 waiting): 3 x 12 = 36 tokens a step, over the 32-token floor and
    under the 64 it was (an 8-stream decode step is now cheap beside a 64-token chunk)."""
    sched, [worker] = _make(num_blocks=1024, max_num_batched_tokens=2048, max_step_tokens_per_decode=3)
    sink = UpdateSink()
    for i in range(11):
        sched.add_request(_req(f"early{i}", [5, 6, 7, 8], max_tokens=100), sink)
    _run_all(sched, worker, sink, sched.schedule()[0])
    sched.add_request(_req("long", list(range(4, 204)), max_tokens=4), sink)
    step = sched.schedule()[0]
    assert sum(step.num_scheduled_tokens) == 36 > MIN_STEP_TOKENS_WHILE_DECODING
    assert sorted(step.num_scheduled_tokens) == [1] * 11 + [25], "each decode its token, the prompt the rest"


def test_multi_step_round_admits_whole_prefills_and_shrinks_for_chunks() -> None:
    sched, [worker] = _make(num_scheduler_steps=8, max_num_batched_tokens=16)
    sink = UpdateSink()
    sched.add_request(_req("a", [5, 6, 7], max_tokens=50), sink)
    first = sched.schedule()[0]
    assert first.num_steps == 8, "a whole prefill joins an n-step round: it samples, then decodes"
    assert [n.request_id for n in first.new_requests] == ["a"] and first.num_scheduled_tokens == [3]
    assert 0 not in sched.schedule(), "requests are arriving: no n-step round is sent ahead"
    _run_all(sched, worker, sink, first)
    second = sched.schedule()[0]
    assert second.num_steps == 8 and second.num_scheduled_tokens == [1]
    assert 0 not in sched.schedule(), "one quiet round is not yet quiet enough"
    _run_all(sched, worker, sink, second)
    third = sched.schedule()[0]
    fourth = sched.schedule()[0]
    assert fourth.num_steps == 8, "two quiet rounds: the next one is sent ahead (pipelined)"
    assert 0 not in sched.schedule(), "two rounds in flight: no more"
    sched.add_request(_req("b", list(range(4, 34)), max_tokens=50), sink)  # 30 tokens > budget 16
    _run_all(sched, worker, sink, third, fourth)
    chunk = sched.schedule()[0]
    assert chunk.num_steps == 1, "b needs chunking: chunks run in 1-step rounds"
    assert [n.request_id for n in chunk.new_requests] == ["b"] and chunk.num_scheduled_tokens == [15, 1]
    _run_all(sched, worker, sink, chunk)
    last_chunk = sched.schedule()[0]
    assert last_chunk.num_steps == 1, "b is still mid-prefill"
    _run_all(sched, worker, sink, last_chunk)
    assert sched.schedule()[0].num_steps == 8, "prefill done: back to n steps"


def test_multi_step_round_is_cut_to_the_tokens_still_wanted() -> None:
    sched, [worker] = _make(num_scheduler_steps=8)
    sink = UpdateSink()
    sched.add_request(_req("a", [5, 6, 7], max_tokens=4), sink)
    sched.add_request(_req("b", [8, 9], max_tokens=11), sink)
    first = sched.schedule()[0]
    assert first.num_steps == 4, "cut to the 4 tokens the waiting head wants"
    worker.submit(first)
    for out in worker.run_round():
        sched.update_from_output(0, out, sink)
    assert sched.schedule()[0].num_steps == 7, "a is done; b still wants 11 - 4"


def test_abort_frees_blocks_now_and_tells_the_worker_next_round() -> None:
    sched, [worker] = _make(num_blocks=16)
    sink = UpdateSink()
    sched.add_request(_req("a", list(range(4, 14)), max_tokens=50), sink)
    sched.add_request(_req("b", [5, 6], max_tokens=50), sink)
    worker.submit(sched.schedule()[0])
    kv = sched.workers[0].kv
    assert kv is not None and kv.num_free_blocks < 16
    assert sched.abort_request("a", sink)
    assert kv.num_free_blocks == 16 - len(kv.block_table("b"))
    assert [u.stop_reason for u in _updates(sink)] == [StopReason.ABORTED]
    rnd = sched.schedule()[0]
    assert rnd.finished_request_ids == ["a"]
    assert not sched.abort_request("a", sink), "unknown ids are ignored"


def test_deadline_aborts_request() -> None:
    sched, _ = _make()
    sink = UpdateSink()
    request = _req("a", [5, 6])
    request.deadline_unix_s = 100.0
    sched.add_request(request, sink)
    sched.expire_deadlines(99.0, sink)
    assert "a" in sched.requests
    sched.expire_deadlines(100.5, sink)
    assert not sched.requests and _updates(sink)[0].stop_reason is StopReason.ABORTED


def test_connection_close_aborts_only_its_requests() -> None:
    sched, _ = _make()
    sink = UpdateSink()
    for i, conn in enumerate([1, 1, 2]):
        request = _req(f"r{i}", [5, 6])
        request.connection_id = conn
        sched.add_request(request, sink)
    assert sched.abort_connection(1) == 2
    assert list(sched.requests) == ["r2"] and sched.num_unfinished(1) == 0


def test_tokens_after_a_stop_inside_a_round_are_not_forwarded() -> None:
    sched, [worker] = _make(num_scheduler_steps=8, eos_period=3)
    sink = UpdateSink()
    prompt = [5, 6, 7]
    sched.add_request(_req("a", prompt, max_tokens=40), sink)
    tokens = _run_until_done(sched, [worker])
    expected = reference_output(prompt, sched_sampling(40), 256, 64, 3)
    assert tokens["a"] == expected and expected[-1] == EOS_TOKEN_ID and len(expected) < 40


def test_new_request_goes_to_worker_with_longest_prefix_hit_then_least_loaded() -> None:
    sched, workers = _make(num_workers=3)
    sink = UpdateSink()
    shared = list(range(4, 20))
    sched.add_request(_req("a", shared + [30]), sink)
    sched.add_request(_req("b", [40, 41]), sink)
    assert (sched.requests["a"].worker_index, sched.requests["b"].worker_index) == (0, 1)
    _run_until_done(sched, workers)
    sched.add_request(_req("c", shared + [31]), sink)
    sched.add_request(_req("d", [50]), sink)
    assert sched.requests["c"].worker_index == 0  # prefix hit beats load
    assert sched.requests["d"].worker_index == 1  # tie (no hit): least loaded, lowest index


def test_failed_worker_moves_its_requests_and_others_keep_serving() -> None:
    sched, workers = _make(num_workers=2)
    sink = UpdateSink()
    sched.add_request(_req("a", [5, 6]), sink)
    sched.add_request(_req("b", [7, 8]), sink)
    for index, rnd in sched.schedule().items():
        workers[index].submit(rnd)
    sched.fail_worker(0, "stream closed", sink)
    assert not _updates(sink), "nobody fails: the request moves"
    assert sched.requests["a"].worker_index == 1 and sched.requests["a"].num_computed_tokens == 0
    sched.add_request(_req("c", [9]), sink)
    assert sched.requests["c"].worker_index == 1
    tokens = _run_until_done(sched, [FakeWorker(64, 4), workers[1]])  # worker 0's outputs never arrive
    assert {rid: len(t) for rid, t in tokens.items()} == {"a": 8, "b": 8, "c": 8}
    sched.workers[1].kv.check_invariants()  # type: ignore[union-attr]


def test_requests_wait_for_a_worker_to_rejoin_and_a_repeat_offender_fails_alone() -> None:
    sched, workers = _make(num_workers=1, max_worker_failures=2)
    sink = UpdateSink()
    sched.add_request(_req("a", [5, 6]), sink)
    workers[0].submit(sched.schedule()[0])
    sched.fail_worker(0, "stream closed", sink)
    assert sched.requests["a"].worker_index is None and not sched.info().ready  # held: no live worker
    assert sched.stats().num_waiting == 1 and not _updates(sink)
    sched.revive_worker(0, workers[0].info)
    assert sched.requests["a"].worker_index == 0 and sched.info().ready
    workers[0] = FakeWorker(64, 4)
    workers[0].submit(sched.schedule()[0])
    sched.fail_worker(0, "round raised", sink)  # a's second failing worker: it fails alone
    [update] = _updates(sink)
    assert update.request_id == "a" and update.error is not None and "round raised" in update.error.message
    assert not sched.requests


def test_abort_of_a_request_held_for_a_worker() -> None:
    sched, workers = _make(num_workers=1)
    sink = UpdateSink()
    sched.add_request(_req("a", [5, 6]), sink)
    sched.fail_worker(0, "gone", sink)
    assert sched.abort_request("a", sink) and not sched.requests and sched.stats().num_waiting == 0


def test_embed_requests_are_batched_and_pooled() -> None:
    worker = FakeWorker(0, 1, task=RequestKind.EMBED)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), [worker.info])
    sink = UpdateSink()
    for i, n in enumerate([4, 5, 12]):
        sched.add_request(Request(f"e{i}", list(range(4, 4 + n)), kind=RequestKind.EMBED, normalize=i == 1), sink)
    rounds, normalize = [], {}
    while sched.requests:
        rnd = sched.schedule()[0]
        rounds.append([p.request_id for p in rnd.pooling_requests])
        normalize |= {p.request_id: p.normalize for p in rnd.pooling_requests}
        worker.submit(rnd)
        for out in worker.run_round():
            sched.update_from_output(0, out, sink)
    assert rounds == [["e0", "e1"], ["e2"]]  # 12 tokens > budget: runs alone
    assert normalize == {"e0": False, "e1": True, "e2": False}  # each request's own flag, to the worker
    pooled = {u.request_id: u.pooled for u in _updates(sink)}
    assert pooled["e2"] == [12.0, float(sum(range(4, 16)) % 97)]
    assert all(u.stop_reason is StopReason.POOLED for u in _updates(sink))


def test_a_score_request_is_never_normalized() -> None:
    worker = FakeWorker(0, 1, task=RequestKind.SCORE)
    sched = Scheduler(SchedulerConfig(), [worker.info])
    sched.add_request(Request("s0", [5, 6, 7], kind=RequestKind.SCORE, normalize=True), UpdateSink())
    rnd = sched.schedule()[0]
    assert [(p.request_id, p.normalize) for p in rnd.pooling_requests] == [("s0", False)]  # a logit, not a vector


def test_request_state_round_trips_through_a_plain_dict() -> None:
    request = _req("a", [5, 6, 7], max_tokens=9, stop_token_ids=(3, 4), logprobs=2, logit_bias=((5, -1.5), (9, 100.0)))
    request.cache_salts = ("img",)
    request.normalize = True
    request.append_output_token(11)
    request.status = RequestStatus.PREEMPTED
    request.stop_reason = StopReason.LENGTH
    data = json.loads(json.dumps(request.to_dict()))
    back = Request.from_dict(data)
    assert back.to_dict() == request.to_dict()
    assert back.all_token_ids == [5, 6, 7, 11] and back.sampling == request.sampling


def test_a_grammar_survives_the_journal() -> None:
    request = _req("g", [5, 6], grammar=Grammar(GrammarKind.REGEX, "[a-z]+"))
    back = Request.from_dict(json.loads(json.dumps(request.to_dict())))
    assert back.sampling.grammar == Grammar(GrammarKind.REGEX, "[a-z]+")


def test_priority_admission_into_full_running_set_preempts_in_the_next_round() -> None:
    sched, [worker] = _make(num_scheduler_steps=8, max_num_seqs=1, enable_priority_preemption=True)
    sink = UpdateSink()
    sched.add_request(_req("low", [5, 6, 7], max_tokens=50), sink)
    worker.submit(sched.schedule()[0])
    for out in worker.run_round():
        sched.update_from_output(0, out, sink)
    decode = sched.schedule()[0]
    assert decode.num_steps == 8  # nothing waits
    worker.submit(decode)
    for out in worker.run_round():
        sched.update_from_output(0, out, sink)
    sched.add_request(_req("high", [8, 9], priority=1), sink)
    rnd = sched.schedule()[0]
    assert [n.request_id for n in rnd.new_requests] == ["high"], "admitted at once, whole prefill in step 0"
    assert rnd.num_steps == 8 and rnd.num_scheduled_tokens == [2]
    assert rnd.finished_request_ids == ["low"]


def _group(prompt: list[int], n: int, max_tokens: int = 4) -> list[Request]:
    """An n > 1 request as the frontend sends it: n requests, the later ones naming the first."""
    return [Request(request_id=f"s{i}", prompt_token_ids=prompt, shares_prompt_with="s0" if i else "",
                    sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens)) for i in range(n)]


def test_later_samples_wait_for_the_first_then_share_its_prompt_blocks() -> None:
    sched, workers = _make(num_blocks=64, block_size=4, num_workers=2)
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks and a partial one
    sink = UpdateSink()
    for request in _group(prompt, 3):
        sched.add_request(request, sink)
    assert {r.worker_index for r in sched.requests.values()} == {0}  # all on the first sample's worker
    first = sched.schedule()[0]
    assert [n.request_id for n in first.new_requests] == ["s0"]
    assert sched.stats().num_waiting == 2
    workers[0].submit(first)
    sched.update_from_output(0, workers[0].step(), UpdateSink())  # s0 sampled: its prompt is cached
    second = sched.schedule()[0]
    assert [n.request_id for n in second.new_requests] == ["s1", "s2"]
    assert [n.num_computed_tokens for n in second.new_requests] == [12, 12]  # only the partial block runs
    assert second.num_scheduled_tokens[:2] == [2, 2]
    shared = set(sched.workers[0].kv.block_table("s0")[:3])
    assert all(set(sched.workers[0].kv.block_table(s)[:3]) == shared for s in ("s1", "s2"))
    workers[0].submit(second)
    tokens = _run_until_done(sched, workers)
    assert tokens["s1"] == tokens["s2"] == reference_output(prompt, sched_sampling(4), 256, 64, NEVER_EOS)


def test_samples_are_not_held_without_prefix_caching_or_once_the_first_is_gone() -> None:
    sched, _ = _make(enable_prefix_caching=False)
    sink = UpdateSink()
    for request in _group([5, 6, 7, 8, 9], 2):
        sched.add_request(request, sink)
    assert [n.request_id for n in sched.schedule()[0].new_requests] == ["s0", "s1"]

    sched, _ = _make()
    s0, s1, s2 = _group([5, 6, 7, 8, 9], 3)
    sched.add_request(s0, sink)
    sched.add_request(s1, sink)
    sched.abort_request("s0", sink)  # the first sample left before computing: s1 runs on its own
    sched.add_request(s2, sink)  # its first sample is gone: queued at once
    assert [n.request_id for n in sched.schedule()[0].new_requests] == ["s1", "s2"]

    sched, _ = _make(block_size=4)
    for request in _group([5, 6, 7, 8], 2):  # no full block before the last token: nothing to share
        sched.add_request(request, sink)
    assert [n.request_id for n in sched.schedule()[0].new_requests] == ["s0", "s1"]


def test_abort_of_a_held_sample_frees_it() -> None:
    sched, _ = _make()
    sink = UpdateSink()
    for request in _group([5, 6, 7, 8, 9], 2):
        sched.add_request(request, sink)
    assert sched.abort_request("s1", sink)
    assert list(sched.requests) == ["s0"] and len(sched.workers[0].held) == 0


def test_a_shared_prefix_spreads_over_the_workers_once_one_is_overloaded() -> None:
    """Every prompt starts with the same system prompt: the hit worker takes requests until
    it is `allowed_imbalance` ahead, then the other computes the prefix once and both share."""
    sched, workers = _make(num_workers=2)
    sink = UpdateSink()
    system = list(range(4, 36))  # two full blocks
    sched.add_request(_req("warm", system + [40]), sink)
    _run_until_done(sched, workers)
    assert workers[0].kv is not None
    for i in range(24):
        sched.add_request(_req(f"r{i}", system + [41 + i], max_tokens=30), sink)
    placed = [sched.requests[f"r{i}"].worker_index for i in range(24)]
    assert placed[:3] == [0, 0, 0], "a hit wins while the load is close"
    assert abs(placed.count(0) - placed.count(1)) <= 2 + 12 // 4, placed
    assert 1 in placed[3:5], "the other worker takes one as soon as the hit worker is too far ahead"
