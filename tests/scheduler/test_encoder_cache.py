"""The encoder budget and cache, as the scheduler owns them, against in-process fake workers.

The fake worker keeps an encoder cache and fails on any protocol slip (a chunk computing an
image that is not cached, an image encoded twice while cached, a cache past capacity), and
its "model" mixes each image's content into the KV values, so outputs prove correctness.
"""

from __future__ import annotations

import json

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.encoder_budget import derive_encoder_budget
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import RequestUpdate, UpdateSink
from shared.errors import ErrorKind
from shared.execute import ExecuteRound, MultiModalItem
from shared.sampling import SamplingOptions
from tests.scheduler.fake_worker import FakeWorker, reference_output

PLACEHOLDER = 9
NEVER_EOS = 10**9


def image(h: str, offset: int, length: int = 8) -> MultiModalItem:
    return MultiModalItem(h, offset, length)


def vlm_request(request_id: str, prompt: list[int], items: list[MultiModalItem], max_tokens: int = 6) -> Request:
    prompt = list(prompt)
    for item in items:
        prompt[item.offset : item.end] = [PLACEHOLDER] * item.length
    return Request(request_id=request_id, prompt_token_ids=prompt, mm_items=tuple(items),
                   sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens))


def make(tokens_per_item: int = 8, capacity: int | None = None, num_blocks: int = 64, **config: object
         ) -> tuple[Scheduler, FakeWorker]:
    config.setdefault("num_scheduler_steps", 1)
    cfg = SchedulerConfig(**config)  # type: ignore[arg-type]
    budget = derive_encoder_budget(tokens_per_item, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                   cfg.limit_mm_per_prompt)
    worker = FakeWorker(num_blocks, 4, eos_period=NEVER_EOS, mm_tokens_per_item=tokens_per_item,
                        encoder_cache_tokens=budget.cache_tokens if capacity is None else capacity)
    return Scheduler(cfg, [worker.info]), worker


class Driver:
    """Runs whole rounds, records every round sent and checks the manager after each step."""

    def __init__(self, sched: Scheduler, worker: FakeWorker) -> None:
        self.sched, self.worker = sched, worker
        self.rounds: list[ExecuteRound] = []
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, RequestUpdate] = {}

    def add(self, request: Request) -> RequestUpdate | None:
        sink = UpdateSink()
        self.sched.add_request(request, sink)
        updates = [u for batch in sink.by_connection.values() for u in batch]
        return updates[0] if updates else None

    def round(self) -> ExecuteRound | None:
        rnd = self.sched.schedule().get(0)
        if rnd is None:
            return None
        self.rounds.append(rnd)
        self.worker.submit(rnd)
        while self.worker.has_work:
            sink = UpdateSink()
            self.sched.update_from_output(0, self.worker.step(), sink)
            for u in (u for batch in sink.by_connection.values() for u in batch):
                self.tokens.setdefault(u.request_id, []).extend(u.token_ids)
                if u.is_final:
                    self.finals[u.request_id] = u
            encoder = self.sched.workers[0].encoder
            assert encoder is not None
            encoder.check_invariants()
        return rnd

    def run(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.sched.requests:
                return
            self.round()
        raise AssertionError("requests did not finish")


def expected(request: Request, max_model_len: int = 256) -> list[int]:
    return reference_output(request.prompt_token_ids, request.sampling, max_model_len, 64, NEVER_EOS,
                            request.mm_items)


# ---- budget ----


def test_budget_derivation_follows_seed_003() -> None:
    # The PR's example: an item larger than a step (8687 > 8192) -> room for one, plus one.
    assert derive_encoder_budget(8687, 8192, 256, 1).cache_tokens == 2 * 8687
    # Items that fit a step: cdiv(2048, 576) = 4 per step, plus one.
    budget = derive_encoder_budget(576, 2048, 256, 4)
    assert (budget.compute_tokens, budget.cache_tokens) == (5 * 576, 5 * 576)
    # Capped by max_num_seqs * items per prompt (then plus one).
    assert derive_encoder_budget(16, 2048, 1, 2).cache_tokens == 3 * 16


def test_worker_too_small_for_the_budget_fails_at_start() -> None:
    with pytest.raises(ValueError, match="encoder-cache-bytes"):
        make(tokens_per_item=8, capacity=8)


def test_requests_whose_images_can_never_fit_are_rejected() -> None:
    sched, worker = make(limit_mm_per_prompt=1)
    driver = Driver(sched, worker)
    too_many = driver.add(vlm_request("many", list(range(20, 40)), [image("a", 0), image("b", 10)]))
    assert too_many is not None and too_many.error is not None
    assert too_many.error.kind is ErrorKind.INVALID_ARGUMENT and "limit-mm-per-prompt" in too_many.error.message
    outside = driver.add(Request("outside", list(range(20, 30)), mm_items=(image("a", 6),)))
    assert outside is not None and outside.error is not None and "leaves the prompt" in outside.error.message
    text_only = Scheduler(SchedulerConfig(), [FakeWorker(16, 4).info])
    sink = UpdateSink()
    text_only.add_request(vlm_request("img", list(range(20, 40)), [image("a", 0)]), sink)
    [update] = [u for batch in sink.by_connection.values() for u in batch]
    assert update.error is not None and "takes no images" in update.error.message
    assert not sched.requests and not text_only.requests


# ---- scheduling ----


def test_image_split_across_chunks_is_encoded_once_before_its_first_chunk() -> None:
    sched, worker = make(max_num_batched_tokens=6)  # an 8-token image spans two or three chunks
    driver = Driver(sched, worker)
    request = vlm_request("r", list(range(20, 40)), [image("cat", 5)])
    assert driver.add(request) is None
    want = expected(request)
    driver.run()
    encodes = [i for i, r in enumerate(driver.rounds) if r.encoder_hashes]
    frees = [i for i, r in enumerate(driver.rounds) if r.encoder_free_hashes]
    assert encodes == [0]  # chunk [0, 6) reaches the image at 5: encoded whole before it
    assert driver.rounds[0].num_scheduled_tokens == [6] and driver.rounds[1].num_scheduled_tokens == [6]
    assert frees == [3]  # chunk [6, 12) and [12, 18) use it; freed with the round after [12, 18)
    assert worker.num_encoded == 1
    assert driver.tokens["r"] == want


def test_identical_images_in_concurrent_requests_are_encoded_once() -> None:
    sched, worker = make()
    driver = Driver(sched, worker)
    requests = [vlm_request(f"same{i}", [20 + i] * 4 + list(range(30, 46)), [image("cat", 6)]) for i in range(3)]
    requests.append(vlm_request("other", list(range(30, 50)), [image("dog", 6)]))
    for request in requests:
        assert driver.add(request) is None
    driver.run()
    assert worker.num_encoded == 2  # "cat" once for three requests, "dog" once
    for request in requests:
        assert driver.tokens[request.request_id] == expected(request)


def test_image_beyond_the_round_budget_waits_and_the_text_before_it_runs() -> None:
    sched, worker = make(max_num_batched_tokens=64, max_num_seqs=1, limit_mm_per_prompt=1)  # 2 items cached
    driver = Driver(sched, worker)
    encoder = sched.workers[0].encoder
    assert encoder is not None and encoder.budget.cache_tokens == 16
    first = vlm_request("first", list(range(20, 36)), [image("a", 2)], max_tokens=4)
    assert driver.add(first) is None
    plan = encoder.begin_round()
    plan.space_left = 4  # as if the cache were almost full
    second = vlm_request("second", list(range(20, 40)), [image("b", 5)])
    assert encoder.fit(plan, second, 0, 20) == 5  # only the text before the image
    assert encoder.fit(plan, second, 7, 13) == 0  # starts inside it: waits, never negative
    driver.run()
    assert driver.tokens["first"] == expected(first)


def test_seed_003_shared_prefix_recomputing_the_last_block_inside_an_image() -> None:
    """Seed 003's crash: the second of two identical requests hits the prefix cache up to the
    last block boundary, which lies inside the image, so it recomputes the last block and needs
    the image again while other images occupy the budget. No zero or negative chunk, no crash,
    both outputs correct."""
    # 12-token images; budget 8 tokens per step -> one item per step, plus one extra = 24 tokens.
    sched, worker = make(tokens_per_item=12, max_num_batched_tokens=8, max_num_seqs=2, limit_mm_per_prompt=1)
    driver = Driver(sched, worker)
    encoder = sched.workers[0].encoder
    assert encoder is not None and encoder.budget.cache_tokens == 24
    prompt = list(range(20, 36))  # 16 tokens = 4 full blocks of 4; the image [3, 15) ends in the last
    a = vlm_request("a", prompt, [image("cat", 3, 12)])
    assert driver.add(a) is None
    while len(driver.tokens.get("a", [])) < 2:  # a's prompt is computed and cached
        driver.round()
    b = vlm_request("b", prompt, [image("cat", 3, 12)])
    other = vlm_request("other", list(range(40, 56)), [image("dog", 1, 12)])
    assert driver.add(other) is None and driver.add(b) is None
    driver.run()
    for request in (a, b, other):
        assert driver.finals[request.request_id].error is None
        assert driver.tokens[request.request_id] == expected(request)
    assert driver.finals["b"].num_cached_tokens == 12  # 3 blocks hit, the last recomputed
    assert all(n >= 1 for r in driver.rounds for n in r.num_scheduled_tokens)
    assert worker.max_encoder_tokens_seen <= 24
    assert not encoder.entries


def test_encoder_outputs_are_released_on_abort_and_preemption() -> None:
    sched, worker = make(max_num_batched_tokens=6, num_blocks=8)
    driver = Driver(sched, worker)
    request = vlm_request("r", list(range(20, 40)), [image("cat", 4)], max_tokens=2)
    assert driver.add(request) is None
    driver.round()  # chunk [0, 6) takes the image
    encoder = sched.workers[0].encoder
    assert encoder is not None and "cat" in encoder.entries
    sched.abort_request("r", UpdateSink())
    assert not encoder.entries and encoder.num_used_tokens == 0
    assert encoder.take_frees() == ["cat"]


def test_encoder_cache_metrics_follow_the_cache() -> None:
    sched, worker = make(max_num_batched_tokens=6)
    metrics = SchedulerMetrics(lambda: sched)
    driver = Driver(sched, worker)

    def value(name: str) -> float:
        got = metrics.registry.get_sample_value(name, {"model_name": "fake", "worker": "0"})
        assert got is not None, name
        return got

    assert driver.add(vlm_request("r", list(range(20, 40)), [image("cat", 4)], max_tokens=2)) is None
    driver.round()  # chunk [0, 6) holds the image
    assert value("spindle:encoder_cache_usage_perc") == pytest.approx(8 / sched.workers[0].encoder.budget.cache_tokens)
    driver.run()
    assert value("spindle:encoder_cache_usage_perc") == 0.0
    assert value("spindle:encoder_items_encoded_total") == 1


def test_images_survive_the_journal() -> None:
    item = MultiModalItem("cat", 2, 8, b"\x00\x01\xfe\xff" * 3, (3, 1, 1))
    request = vlm_request("r", list(range(20, 40)), [item])
    data = request.to_dict()
    assert json.loads(json.dumps(data)) == data  # plain data only
    assert Request.from_dict(data).mm_items == (item,)
