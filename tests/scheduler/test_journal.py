"""The journal writes nothing where no store would outlive the scheduler (the `memory` one)."""

from __future__ import annotations

import asyncio

from services.scheduler.journal import Journal
from services.scheduler.request import Request
from shared.sampling import SamplingOptions
from shared.state_store import InMemoryStateStore, open_state_store


async def test_without_a_store_every_hook_is_a_no_op() -> None:
    request = Request("a", [1, 2, 3], SamplingOptions(temperature=0.0, max_tokens=4))
    journal = Journal(None, {"a": request}.get)
    journal.on_added(request, 0)
    request.output_token_ids.append(9)
    journal.note_progress(["a"])
    journal.replace("a")
    journal.forget("a")
    await asyncio.sleep(0)  # where a flush would run
    assert journal.num_writes == 0 and journal._task is None and not journal._batch
    assert await journal.load() == []
    await journal.drain()


async def test_with_a_store_the_same_hooks_write() -> None:
    store = InMemoryStateStore()
    request = Request("a", [1, 2, 3], SamplingOptions(temperature=0.0, max_tokens=4))
    journal = Journal(store, {"a": request}.get)
    journal.on_added(request, 0)
    request.output_token_ids.append(9)
    journal.note_progress(["a"])
    await journal.drain()
    assert [r.output_token_ids for r in await journal.load()] == [[9]]


def test_only_the_memory_store_dies_with_its_process() -> None:
    assert not open_state_store("memory").outlives_process
    assert open_state_store("redis://127.0.0.1:1").outlives_process  # not connected until used
