"""Randomised end-to-end scheduling against fake workers: thousands of steps, invariants each step.

Every request's output must equal what the fake model produces for it alone, whatever
happened to it (chunking, prefix hits, preemption, multi-step rounds, pipelining, several
workers); aborted ones must have received a prefix of it, and nothing after a final update.
"""

from __future__ import annotations

import pytest

from services.scheduler.request import RequestStatus
from shared.types import StopReason
from tests.scheduler.harness import Harness, HarnessResult, HarnessSpec


def check_outputs(result: HarnessResult) -> None:
    for request_id, view in result.views.items():
        assert view.reference[: len(view.tokens)] == view.tokens, f"{request_id}: output diverged"
        if view.connection_closed and not view.finals:
            continue
        assert len(view.finals) == 1, f"{request_id}: {len(view.finals)} final updates"
        final = view.finals[0]
        assert final.error is None, f"{request_id}: {final.error}"
        if final.stop_reason is StopReason.ABORTED:
            assert view.aborted_by_client or view.request.deadline_unix_s > 0, f"{request_id} aborted unasked"
        else:
            assert view.tokens == view.reference, f"{request_id}: {view.tokens} != {view.reference}"
            expected = StopReason.LENGTH if len(view.tokens) in (
                view.request.sampling.max_tokens, 80 - view.request.num_prompt_tokens) else None
            if expected is not None and final.stop_reason is not StopReason.STOP_TOKEN:
                assert final.stop_reason is expected
        assert view.request.status is RequestStatus.FINISHED


def check_drained(result: HarnessResult) -> None:
    sched = result.scheduler
    assert not sched.requests
    for ws, worker in zip(sched.workers, result.workers, strict=True):
        assert ws.kv is not None
        assert ws.kv.num_free_blocks == ws.kv.num_blocks, "blocks still held after every request ended"
        assert not ws.running and not ws.waiting and not ws.draining and not ws.held and not ws.inflight
        # The worker still holds exactly the requests whose finish has not been sent yet.
        assert set(worker.requests) == set(ws.pending_finished_ids)


CONFIGS = {
    "1w-1step-small-pool": HarnessSpec(seed=1, num_blocks=36),
    "1w-4step-small-pool": HarnessSpec(seed=2, num_scheduler_steps=4, num_blocks=40),
    "1w-8step": HarnessSpec(seed=3, num_scheduler_steps=8, num_blocks=48),
    "2w-1step": HarnessSpec(seed=4, num_workers=2, num_blocks=40),
    "2w-4step": HarnessSpec(seed=5, num_workers=2, num_scheduler_steps=4, num_blocks=40),
    "3w-8step": HarnessSpec(seed=6, num_workers=3, num_scheduler_steps=8, num_blocks=40),
    "priority-preemption": HarnessSpec(seed=7, num_scheduler_steps=4, num_blocks=40,
                                       enable_priority_preemption=True),
    "long-prompts-priority-8step": HarnessSpec(seed=9, num_scheduler_steps=8, num_blocks=48, max_prompt=79,
                                               enable_priority_preemption=True),
    "no-prefix-cache": HarnessSpec(seed=8, num_scheduler_steps=4, num_blocks=40, enable_prefix_caching=False),
    # The default policy: multi-step rounds go ahead only in quiet stretches.
    "2w-8step-adaptive-pipelining": HarnessSpec(seed=10, num_workers=2, num_scheduler_steps=8, num_blocks=48,
                                                pipeline_quiet_rounds=2),
    # n > 1: later samples held until the first cached the prompt, then sharing its blocks.
    "n-samples-2w-8step": HarnessSpec(seed=11, num_workers=2, num_scheduler_steps=8, num_blocks=48,
                                      group_prob=0.3),
    "n-samples-1step-no-prefix-cache": HarnessSpec(seed=12, num_blocks=40, group_prob=0.3, num_requests=900,
                                                   enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_workload_matches_reference(name: str) -> None:
    spec = CONFIGS[name]
    result = Harness(spec).run()
    check_outputs(result)
    check_drained(result)
    stats = result.scheduler.stats()
    assert result.num_steps > 1000, "the workload was meant to run for many steps"
    min_pipelined = 100 if spec.pipeline_quiet_rounds == 0 else 1
    assert result.num_pipelined_rounds >= min_pipelined, "rounds were meant to be sent while others still ran"
    assert stats.num_preemptions > 0, "the pool was meant to be small enough to force preemption"
    assert sum(w.num_partial_prefills for w in result.workers) > 0, "no prompt was chunked"
    if spec.enable_prefix_caching:
        assert stats.num_prefix_hit_tokens > 0
    if spec.num_scheduler_steps > 1:
        assert sum(w.num_multi_step_rounds for w in result.workers) > 0
