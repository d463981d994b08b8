"""The state store: journal batches and windowed counters, in memory and in a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.frontend.rate_limit import RateLimiter
from shared.errors import ResourceExhaustedError
from shared.state_store import InMemoryStateStore, JournalBatch, RedisStateStore, StateStore, open_state_store
from tests.e2e.faults import RedisServer, redis_server


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis: RedisServer) -> AsyncIterator[StateStore]:
    if request.param == "memory":
        yield InMemoryStateStore()
        return
    redis_store = RedisStateStore(redis.url)
    await redis_store._redis.flushdb()
    yield redis_store
    await redis_store.close()


async def test_journal_batches_add_append_replace_and_remove(store: StateStore) -> None:
    await store.write_journal(JournalBatch(added={"a": b'{"x": 1}', "b": b"{}"}, appended={"a": [5, 6]}))
    await store.write_journal(JournalBatch(appended={"a": [7], "b": [9]}))
    journal = await store.read_journal()
    assert {rid: (e.record, e.output_token_ids) for rid, e in journal.items()} == {
        "a": (b'{"x": 1}', [5, 6, 7]), "b": (b"{}", [9])}
    # A re-submitted request: removed, then added afresh in one batch (its old output dropped).
    await store.write_journal(JournalBatch(removed=["a"], added={"a": b'{"x": 2}'}, appended={"a": [1]}))
    await store.write_journal(JournalBatch(removed=["b"]))
    journal = await store.read_journal()
    assert {rid: (e.record, e.output_token_ids) for rid, e in journal.items()} == {"a": (b'{"x": 2}', [1])}


async def test_counters_count_per_key(store: StateStore) -> None:
    assert [await store.incr_window("k", 60) for _ in range(3)] == [1, 2, 3]
    assert await store.incr_window("other", 60) == 1


async def test_journal_survives_a_redis_restart_with_aof(redis: RedisServer) -> None:
    store = RedisStateStore(redis.url)
    await store._redis.flushdb()
    await store.write_journal(JournalBatch(added={"r": b"{}"}, appended={"r": [1, 2, 3]}))
    await store.close()
    redis.restart()
    store = RedisStateStore(redis.url)
    assert (await store.read_journal())["r"].output_token_ids == [1, 2, 3]
    await store.close()


async def test_rate_limit_is_shared_by_replicas_through_redis(redis: RedisServer) -> None:
    stores = [RedisStateStore(redis.url), RedisStateStore(redis.url)]
    await stores[0]._redis.flushdb()
    replicas = [RateLimiter(s, requests_per_minute=3) for s in stores]
    for limiter in (replicas[0], replicas[1], replicas[0]):
        await limiter.check("key-1")
    with pytest.raises(ResourceExhaustedError) as info:
        await replicas[1].check("key-1")  # the 4th request of this minute, on the other replica
    assert 1 <= (info.value.retry_after_s or 0) <= 60 and "3 requests per minute" in info.value.message
    await replicas[1].check("key-2")  # another key has its own budget
    for s in stores:
        await s.close()


async def test_rate_limit_lets_requests_through_when_the_store_is_down(tmp_path: Path) -> None:
    limiter = RateLimiter(RedisStateStore("redis://127.0.0.1:1/0"), requests_per_minute=1)
    for _ in range(3):
        await limiter.check("key")


def test_store_urls() -> None:
    assert isinstance(open_state_store("memory"), InMemoryStateStore)
    assert isinstance(open_state_store("redis://127.0.0.1:6379/0"), RedisStateStore)
    with pytest.raises(ValueError, match="state_store='mysql://x'"):
        open_state_store("mysql://x")
