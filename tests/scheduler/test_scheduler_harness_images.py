"""Randomised scheduling with images: shared prefixes, identical and different images, chunked
prefill splitting images, preemption, multi-step and pipelining, against fake workers.

After every step: the encoder cache is within budget on both sides, every live entry is held,
requests that are not running hold nothing, and the worker never computes an image that is
not cached (nothing freed while needed). At the end nothing is leaked: the scheduler holds no
entry, and the worker holds exactly the frees not yet sent. Outputs equal the reference,
whose "model" depends on each image's content.
"""

from __future__ import annotations

import pytest

from tests.scheduler.harness import Harness, HarnessSpec
from tests.scheduler.test_scheduler_harness import check_drained, check_outputs

CONFIGS = {
    "images-1step-chunked": HarnessSpec(seed=21, num_blocks=36, max_num_batched_tokens=16, image_prob=0.7,
                                        num_requests=400),
    "images-4step-2workers": HarnessSpec(seed=22, num_workers=2, num_scheduler_steps=4, num_blocks=40,
                                         max_num_batched_tokens=24, tokens_per_image=12, image_prob=0.6,
                                         num_requests=400, enable_priority_preemption=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_workload_with_images(name: str) -> None:
    spec = CONFIGS[name]
    result = Harness(spec).run()
    check_outputs(result)
    check_drained(result)
    for ws, worker in zip(result.scheduler.workers, result.workers, strict=True):
        assert ws.encoder is not None
        assert not ws.encoder.entries and ws.encoder.num_used_tokens == 0, "encoder entries leaked"
        assert set(worker.encoder_cache) == set(ws.encoder.pending_free), "worker holds outputs nobody frees"
        assert worker.max_encoder_tokens_seen <= ws.encoder.budget.cache_tokens
    stats = result.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens > 0
    assert sum(w.num_split_images for w in result.workers) > 0, "no image was split across chunks"
    assert sum(w.num_encoded for w in result.workers) > 0
    assert sum(ws.encoder.num_hits for ws in result.scheduler.workers if ws.encoder) > 0
    if spec.num_scheduler_steps > 1:
        assert sum(w.num_multi_step_rounds for w in result.workers) > 0
