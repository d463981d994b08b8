"""`WaitingQueue`: requests waiting for admission, higher priority first, FCFS within one.

A heap keyed by (-priority, arrival_seq) with lazy removal, so push/pop are O(log n) and
removing an aborted request is O(1). A preempted request keeps its arrival_seq and so goes
back ahead of everything that arrived after it. It counts the tokens its requests will
prefill, the measure of waiting work that backpressure bounds.
"""

from __future__ import annotations

import heapq

from services.scheduler.request import Request


class WaitingQueue:
    """Priority queue of waiting requests with O(1) removal by id."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._live: dict[str, int] = {}  # request_id -> push generation of its live entry
        self._num_tokens: dict[str, int] = {}  # request_id -> its tokens when pushed
        self._generation = 0
        self.num_tokens = 0  # tokens of every live request (prompt, plus output when preempted)

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def push(self, request: Request) -> None:
        assert request.request_id not in self._live, f"{request.request_id} queued twice"
        self._generation += 1
        self._live[request.request_id] = self._generation
        self._num_tokens[request.request_id] = request.num_tokens
        self.num_tokens += request.num_tokens
        heapq.heappush(self._heap, (-request.priority, request.arrival_seq, self._generation, request))

    def peek(self) -> Request:
        self._drop_dead()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_dead()
        request = heapq.heappop(self._heap)[3]
        del self._live[request.request_id]
        self.num_tokens -= self._num_tokens.pop(request.request_id)
        return request

    def remove(self, request_id: str) -> bool:
        """Forget the request (its heap entry is skipped later); False if it was not queued."""
        if self._live.pop(request_id, None) is None:
            return False
        self.num_tokens -= self._num_tokens.pop(request_id)
        return True

    def requests(self) -> list[Request]:
        """Live requests, in no particular order."""
        return [entry[3] for entry in self._heap if self._live.get(entry[3].request_id) == entry[2]]

    def _drop_dead(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][3].request_id) != heap[0][2]:
            heapq.heappop(heap)
