"""`StateStore`: where accepted requests are journaled and rate-limit counters live.

Two implementations behind one small interface: `InMemoryStateStore` (the embedded default
for `spindle serve`: survives nothing but costs nothing) and `RedisStateStore` (`redis://`
URLs, for Kubernetes: a restarted scheduler reads the journal back; frontend replicas share
counters). Values are bytes the caller serialises (JSON, never pickle). Journal writes are
batched by the caller: one `write_journal` per flush carries every change since the last.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

JOURNAL_REQUESTS = "spindle:journal:requests"  # hash: request_id -> request record (JSON)
JOURNAL_OUTPUT = "spindle:journal:output:"  # list per request: output token ids, appended


@dataclass(slots=True)
class JournalBatch:
    """Every journal change since the last flush. Applied in order: removed, added, appended."""

    added: dict[str, bytes] = field(default_factory=dict)  # request_id -> record
    appended: dict[str, list[int]] = field(default_factory=dict)  # request_id -> new output tokens
    removed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.appended or self.removed)


@dataclass(slots=True, frozen=True)
class JournalEntry:
    record: bytes
    output_token_ids: list[int]


class StateStore(abc.ABC):
    """Journal of accepted requests plus windowed counters."""

    outlives_process = True  # what it holds is still there for the next process that opens it

    @abc.abstractmethod
    async def write_journal(self, batch: JournalBatch) -> None:
        """Apply one batch (one round trip for Redis)."""

    @abc.abstractmethod
    async def read_journal(self) -> dict[str, JournalEntry]:
        """Every request still journaled, with its output tokens."""

    @abc.abstractmethod
    async def incr_window(self, key: str, window_s: int) -> int:
        """Add one to `key`'s counter for the current `window_s`-second window; returns the new count."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class InMemoryStateStore(StateStore):
    outlives_process = False

    def __init__(self) -> None:
        self._records: dict[str, bytes] = {}
        self._outputs: dict[str, list[int]] = {}
        self._counters: dict[tuple[str, int], int] = {}

    async def write_journal(self, batch: JournalBatch) -> None:
        for request_id in batch.removed:
            self._records.pop(request_id, None)
            self._outputs.pop(request_id, None)
        self._records.update(batch.added)
        for request_id, tokens in batch.appended.items():
            self._outputs.setdefault(request_id, []).extend(tokens)

    async def read_journal(self) -> dict[str, JournalEntry]:
        return {rid: JournalEntry(rec, list(self._outputs.get(rid, ()))) for rid, rec in self._records.items()}

    async def incr_window(self, key: str, window_s: int) -> int:
        window = int(time.time()) // window_s
        for old in [k for k in self._counters if k[0] == key and k[1] != window]:
            del self._counters[old]
        count = self._counters.get((key, window), 0) + 1
        self._counters[(key, window)] = count
        return count


class RedisStateStore(StateStore):
    """Redis-backed store; run Redis with AOF (`appendonly yes`) so a Redis restart loses nothing."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as redis

        self.url = url
        self._redis = redis.Redis.from_url(url)

    async def write_journal(self, batch: JournalBatch) -> None:
        pipe = self._redis.pipeline(transaction=True)  # a batch lands whole or not at all
        if batch.removed:  # first: a re-submitted request is removed, then added afresh
            pipe.hdel(JOURNAL_REQUESTS, *batch.removed)
            pipe.delete(*(JOURNAL_OUTPUT + rid for rid in batch.removed))
        if batch.added:
            pipe.hset(JOURNAL_REQUESTS, mapping=batch.added)
        for request_id, tokens in batch.appended.items():
            if tokens:
                pipe.rpush(JOURNAL_OUTPUT + request_id, *tokens)
        await pipe.execute()

    async def read_journal(self) -> dict[str, JournalEntry]:
        records: Mapping[bytes, bytes] = await self._redis.hgetall(JOURNAL_REQUESTS)
        ids = [k.decode() for k in records]
        pipe = self._redis.pipeline(transaction=False)
        for request_id in ids:
            pipe.lrange(JOURNAL_OUTPUT + request_id, 0, -1)
        outputs: Sequence[list[bytes]] = await pipe.execute() if ids else []
        return {rid: JournalEntry(records[rid.encode()], [int(t) for t in out]) for rid, out in zip(ids, outputs,
                                                                                                     strict=True)}

    async def incr_window(self, key: str, window_s: int) -> int:
        window_key = f"spindle:rate:{key}:{int(time.time()) // window_s}"
        pipe = self._redis.pipeline(transaction=True)
        pipe.incr(window_key)
        pipe.expire(window_key, window_s * 2)
        count, _ = await pipe.execute()
        return int(count)

    async def close(self) -> None:
        await self._redis.aclose()


def open_state_store(url: str) -> StateStore:
    """`memory` (or empty) -> in-process; `redis://` / `rediss://` / `unix://` -> Redis."""
    if url in ("", "memory"):
        return InMemoryStateStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStateStore(url)
    raise ValueError(f"state_store={url!r} must be 'memory' or a redis:// URL")
