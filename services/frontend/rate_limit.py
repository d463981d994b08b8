"""`RateLimiter`: requests per minute per API key, counted in the state store.

With a Redis state store every frontend replica counts into the same fixed one-minute window,
so a key's limit holds across replicas. Past the limit a request gets RESOURCE_EXHAUSTED /
HTTP 429 with `Retry-After` set to the seconds left in the window. If the store cannot be
reached the request is let through (logged): rate limiting must never take serving down.
"""

from __future__ import annotations

import logging
import time

from shared.errors import ResourceExhaustedError
from shared.state_store import StateStore

logger = logging.getLogger(__name__)

WINDOW_S = 60


class RateLimiter:
    """Args: store: shared counters; requests_per_minute: per key (0: no limit)."""

    def __init__(self, store: StateStore, requests_per_minute: int) -> None:
        self.store = store
        self.requests_per_minute = requests_per_minute

    async def check(self, api_key_id: str) -> None:
        """Count one request for the key ("" when keys are off: one shared budget); raise past the limit."""
        if self.requests_per_minute <= 0:
            return
        try:
            count = await self.store.incr_window(f"requests:{api_key_id or 'anonymous'}", WINDOW_S)
        except Exception as exc:  # the store is down: serve rather than refuse everyone
            logger.warning("rate limit not enforced: the state store failed (%s: %s)", type(exc).__name__, exc)
            return
        if count > self.requests_per_minute:
            error = ResourceExhaustedError(f"rate limit: {self.requests_per_minute} requests per minute per API key; "
                                           "retry after the current minute")
            error.retry_after_s = max(1, WINDOW_S - int(time.time()) % WINDOW_S)
            raise error
