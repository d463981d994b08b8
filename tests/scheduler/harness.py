"""Drives `Scheduler` against `FakeWorker`s in-process and checks invariants after every step.

Random arrivals (shared prefixes, priorities, stop ids, min_tokens, ignore_eos, logprobs,
deadlines, images from a small pool so identical ones meet, groups of samples of one n > 1
request), random aborts and closed
frontend connections, random interleaving of worker steps with scheduling (so two rounds are
often in flight). Deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.scheduler.config import SchedulerConfig
from services.scheduler.encoder_budget import derive_encoder_budget
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.updates import RequestUpdate, UpdateSink
from shared.execute import ExecuteRound, MultiModalItem
from shared.sampling import SamplingOptions
from tests.scheduler.fake_worker import FakeWorker, reference_output


@dataclass
class HarnessSpec:
    seed: int = 0
    num_workers: int = 1
    num_scheduler_steps: int = 1
    num_blocks: int = 64
    block_size: int = 4
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 48
    num_requests: int = 600
    max_prompt: int = 40
    max_output: int = 60
    max_model_len: int = 80
    abort_prob: float = 0.03  # per tick
    enable_priority_preemption: bool = False
    enable_prefix_caching: bool = True
    pipeline_quiet_rounds: int = 0  # always pipeline: rounds in flight are what the invariants stress
    eos_period: int = 50
    max_ticks: int = 50_000
    image_prob: float = 0.0  # share of requests carrying images (a vision-language worker when > 0)
    tokens_per_image: int = 8
    limit_mm_per_prompt: int = 2
    group_prob: float = 0.0  # share of arrivals that are n > 1 requests (2..4 samples sharing the prompt)


@dataclass
class ClientView:
    """What a frontend saw of one request."""

    request: Request
    reference: list[int]
    tokens: list[int] = field(default_factory=list)
    finals: list[RequestUpdate] = field(default_factory=list)
    aborted_by_client: bool = False
    connection_closed: bool = False


@dataclass
class HarnessResult:
    views: dict[str, ClientView]
    scheduler: Scheduler
    workers: list[FakeWorker]
    num_steps: int
    max_running_seen: int
    num_pipelined_rounds: int  # rounds sent while the worker had not finished the previous one


class Harness:
    def __init__(self, spec: HarnessSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.config = SchedulerConfig(
            max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
            num_scheduler_steps=spec.num_scheduler_steps, enable_prefix_caching=spec.enable_prefix_caching,
            enable_priority_preemption=spec.enable_priority_preemption,
            pipeline_quiet_rounds=spec.pipeline_quiet_rounds, limit_mm_per_prompt=spec.limit_mm_per_prompt)
        self.encoder_budget = derive_encoder_budget(
            spec.tokens_per_image, spec.max_num_batched_tokens, spec.max_num_seqs, spec.limit_mm_per_prompt
        ) if spec.image_prob > 0 else None
        mm = {"mm_tokens_per_item": spec.tokens_per_image,
              "encoder_cache_tokens": self.encoder_budget.cache_tokens} if self.encoder_budget else {}
        self.workers = [FakeWorker(spec.num_blocks, spec.block_size, max_model_len=spec.max_model_len,
                                   eos_period=spec.eos_period, **mm)  # type: ignore[arg-type]
                        for _ in range(spec.num_workers)]
        self.scheduler = Scheduler(self.config, [w.info for w in self.workers])
        for ws, worker in zip(self.scheduler.workers, self.workers, strict=True):
            self._guard_cache_blocks(ws.kv, worker)
        self.views: dict[str, ClientView] = {}
        self.prefixes = [[self.rng.randrange(4, 64) for _ in range(self.rng.randint(4, 24))] for _ in range(4)]
        self.tick = 0
        self.num_steps = 0
        self.max_running_seen = 0
        self.num_pipelined_rounds = 0

    # ---- workload ----

    def make_request(self, index: int) -> Request:
        rng, spec = self.rng, self.spec
        prompt = [rng.randrange(4, 64) for _ in range(rng.randint(1, spec.max_prompt))]
        if rng.random() < 0.5:
            prompt = self.prefixes[rng.randrange(len(self.prefixes))] + prompt[: rng.randint(0, 12)]
        prompt = prompt[: spec.max_model_len - 1]
        sampling = SamplingOptions(
            temperature=0.0,
            max_tokens=rng.randint(1, spec.max_output),
            min_tokens=rng.choice([0, 0, 0, 2, 5]),
            stop_token_ids=tuple(rng.sample(range(4, 64), rng.choice([0, 0, 1, 2]))),
            ignore_eos=rng.random() < 0.15,
            logprobs=rng.choice([None, None, None, 0, 2]),
        )
        deadline = float(self.tick + rng.randint(5, 80)) if rng.random() < 0.03 else 0.0
        items = self.make_images(prompt) if rng.random() < spec.image_prob else ()
        return Request(request_id=f"r{index}", prompt_token_ids=prompt, sampling=sampling,
                       priority=rng.choice([0, 0, 0, 1, 2]), connection_id=rng.randrange(3),
                       deadline_unix_s=deadline, mm_items=items)

    def make_group(self, index: int) -> list[Request]:
        """One request, or (with `group_prob`) the samples of an n > 1 one, as the frontend sends them."""
        first = self.make_request(index)
        if not self.spec.group_prob or self.rng.random() >= self.spec.group_prob:
            return [first]
        return [first] + [
            Request(request_id=f"r{index + i}", prompt_token_ids=list(first.prompt_token_ids), sampling=first.sampling,
                    priority=first.priority, connection_id=first.connection_id, deadline_unix_s=first.deadline_unix_s,
                    mm_items=first.mm_items, shares_prompt_with=first.request_id)
            for i in range(1, self.rng.randint(2, 4))
        ]

    def make_images(self, prompt: list[int]) -> tuple[MultiModalItem, ...]:
        """1..limit images from a pool of 3, placeholders written over the prompt (in place).

        The first often sits at offset 2, inside the shared prefixes, so prefix hits meet both
        identical and different images at the same place.
        """
        rng, length = self.rng, self.spec.tokens_per_image
        items: list[MultiModalItem] = []
        offset = 2 if rng.random() < 0.5 else rng.randint(0, 6)
        for _ in range(rng.randint(1, self.spec.limit_mm_per_prompt)):
            if offset + length > len(prompt):
                break
            items.append(MultiModalItem(f"img{rng.randrange(3)}", offset, length))
            prompt[offset : offset + length] = [2] * length
            offset += length + rng.randint(0, 6)
        return tuple(items)

    # ---- loop ----

    def run(self) -> HarnessResult:
        spec, rng, sched = self.spec, self.rng, self.scheduler
        num_added = 0
        while num_added < spec.num_requests or sched.requests or any(w.has_work for w in self.workers):
            self.tick += 1
            assert self.tick < spec.max_ticks, f"no progress after {self.tick} ticks: {sched.stats()}"
            sink = UpdateSink()
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3]) if num_added < spec.num_requests else 0):
                group = self.make_group(num_added)
                num_added += len(group)
                for request in group:
                    self.views[request.request_id] = ClientView(request, reference_output(
                        request.prompt_token_ids, request.sampling, spec.max_model_len, 64, spec.eos_period,
                        request.mm_items))
                    sched.add_request(request, sink)
            self._random_aborts(sink)
            sched.expire_deadlines(float(self.tick), sink)
            self._deliver(sink)
            self.check()
            for index, request_ids in sched.take_aborts().items():
                self.workers[index].abort(request_ids)
            for index, rnd in sched.schedule().items():
                self._check_round(rnd)
                self.num_pipelined_rounds += self.workers[index].has_work
                self.workers[index].submit(rnd)
            self.check()
            for index, worker in enumerate(self.workers):
                for _ in range(rng.choice([0, 1, 1, 2, 3])):
                    if not worker.has_work:
                        break
                    sink = UpdateSink()
                    sched.update_from_output(index, worker.step(), sink)
                    self.num_steps += 1
                    self._deliver(sink)
                    self.check()
        return HarnessResult(self.views, sched, self.workers, self.num_steps, self.max_running_seen,
                             self.num_pipelined_rounds)

    def _random_aborts(self, sink: UpdateSink) -> None:
        sched, rng = self.scheduler, self.rng
        if sched.requests and rng.random() < self.spec.abort_prob:
            request_id = rng.choice(sorted(sched.requests))
            self.views[request_id].aborted_by_client = True
            assert sched.abort_request(request_id, sink)
            self._deliver(sink)
            sink.by_connection.clear()
        if sched.requests and rng.random() < 0.001:
            connection_id = rng.randrange(3)
            for view in self.views.values():
                if view.request.connection_id == connection_id and not view.finals:
                    view.connection_closed = True
            sched.abort_connection(connection_id)

    def _deliver(self, sink: UpdateSink) -> None:
        for connection_id, updates in sink.by_connection.items():
            seen: set[str] = set()
            for update in updates:
                view = self.views[update.request_id]
                assert update.request_id not in seen, "two updates for one request in one step message"
                seen.add(update.request_id)
                assert view.request.connection_id == connection_id, "update routed to the wrong frontend"
                assert not view.connection_closed, f"{update.request_id}: update after its connection closed"
                assert not view.finals, f"{update.request_id}: update after its final update {view.finals}"
                view.tokens.extend(update.token_ids)
                if update.is_final:
                    view.finals.append(update)

    # ---- invariants ----

    @staticmethod
    def _guard_cache_blocks(kv: KVBlockManager | None, worker: FakeWorker) -> None:
        """Blocks may enter the prefix cache only up to what the worker has really computed."""
        assert kv is not None
        original = kv.cache_blocks

        def checked(request: Request, num_computed_tokens: int) -> None:
            if kv.has_blocks(request.request_id):
                state = worker.requests[request.request_id]
                assert num_computed_tokens <= state.num_computed, (
                    f"{request.request_id}: caches blocks up to {num_computed_tokens} tokens, the worker "
                    f"computed {state.num_computed}")
            original(request, num_computed_tokens)

        kv.cache_blocks = checked  # type: ignore[method-assign]

    def _check_round(self, rnd: ExecuteRound) -> None:
        scheduled = rnd.num_scheduled_tokens
        assert sum(scheduled) <= self.config.max_num_batched_tokens, f"token budget exceeded: {sum(scheduled)}"
        assert len(scheduled) <= self.config.max_num_seqs, "max_num_seqs exceeded in a round"
        assert all(n >= 1 for n in scheduled), "a request was scheduled with zero new tokens"
        assert rnd.num_steps <= self.config.num_scheduler_steps
        if self.encoder_budget is not None:
            encoded = sum(self.spec.tokens_per_image for _ in rnd.encoder_hashes)
            assert encoded <= self.encoder_budget.compute_tokens, f"encoder compute budget exceeded: {encoded}"
            assert len(set(rnd.encoder_hashes)) == len(rnd.encoder_hashes), "an image encoded twice in a round"

    def check(self) -> None:
        sched = self.scheduler
        for ws in sched.workers:
            assert ws.kv is not None
            ws.kv.check_invariants()
            if ws.encoder is not None:
                ws.encoder.check_invariants()  # within budget, every live entry held
                for request in ws.requests.values():
                    if request.status is not RequestStatus.RUNNING:
                        assert all(request.request_id not in {k[0] for k in e.holders}
                                   for e in ws.encoder.entries.values()), f"{request.request_id} holds images"
            assert len(ws.running) <= self.config.max_num_seqs, "max_num_seqs exceeded"
            self.max_running_seen = max(self.max_running_seen, len(ws.running))
            for request in ws.running:
                assert request.status is RequestStatus.RUNNING
                assert ws.kv.has_blocks(request.request_id)
            for request in ws.requests.values():
                assert sched.requests[request.request_id] is request
                if request.status is not RequestStatus.RUNNING:
                    assert not ws.kv.has_blocks(request.request_id), f"{request.request_id} holds blocks"
            num_placed = len(ws.running) + len(ws.waiting) + len(ws.draining) + len(ws.held)
            assert num_placed == len(ws.requests), "a request is in no queue or in two"
        assert len(sched.requests) == sum(len(ws.requests) for ws in sched.workers)
