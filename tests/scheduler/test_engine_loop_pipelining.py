"""One scheduling pass fills every round slot a worker has, not one per wake-up."""

from __future__ import annotations

import asyncio

from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.request import Request
from shared.execute import ExecuteRound, WorkerInfo
from shared.sampling import SamplingOptions
from tests.scheduler.fake_worker import FakeWorker


class RecordingLink:
    """A worker link that answers ready at once and keeps the rounds sent to it."""

    def __init__(self, info: WorkerInfo) -> None:
        self.address = "fake:0"
        self.info = info
        self.sent: list[ExecuteRound] = []

    async def wait_ready(self) -> WorkerInfo:
        return self.info

    def open(self, on_output: object, on_failure: object) -> None:
        pass

    def send(self, rnd: ExecuteRound) -> None:
        self.sent.append(rnd)

    def abort(self, request_ids: list[str]) -> None:
        pass

    async def close(self) -> None:
        pass


def test_one_step_rounds_are_sent_two_deep() -> None:
    """A prompt chunked over 1-step rounds: the pass that sends its first chunk sends the next
    one too (max_inflight_rounds=2), so the worker has the next round while the first's output
    makes its way back. One round per pass left the worker idle through every round trip."""
    link = RecordingLink(FakeWorker(64, 4, max_model_len=256).info)
    config = SchedulerConfig(num_scheduler_steps=8, max_num_batched_tokens=16, max_inflight_rounds=2)

    async def scenario() -> list[ExecuteRound]:
        loop = EngineLoop(config, [link])  # type: ignore[list-item]
        await loop.start()
        try:
            conn = loop.connect()
            loop.add_requests(conn.id, [Request(request_id="long", prompt_token_ids=list(range(4, 64)),
                                                sampling=SamplingOptions(temperature=0.0, max_tokens=4))])
            loop.step()
            return list(link.sent)
        finally:
            await loop.stop()

    sent = asyncio.run(scenario())
    assert [r.num_steps for r in sent] == [1, 1]
    assert [r.num_scheduled_tokens for r in sent] == [[16], [16]], "two chunks of the 60-token prompt"
