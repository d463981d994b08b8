"""Stop-string matching over a request's incremental output text.

Text arrives a few characters per step and a stop string may span steps, so the matcher
holds back the longest tail that could still become a stop string: no client ever sees
part of a stop string, and on a match the output is cut right before it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Filters one request's text deltas; `matched` is set once a stop string appeared.

    Invariant: the concatenation of every `feed` result and `flush` is the output text, cut
    before the stop string that completes first (the longer one on a tie), if any.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop if s)
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    @property
    def is_active(self) -> bool:
        return bool(self._stops)

    def feed(self, text: str, can_match: bool = True) -> str:
        """Take the next text delta; return the part that is safe to emit now.

        `can_match=False` (before min_tokens) lets the text through unmatched, as vLLM does.
        """
        if not self._stops or self.matched is not None:
            return "" if self.matched is not None else text
        buf = self._held + text
        if not can_match:
            self._held = ""
            return buf
        # Only the held tail plus the new text can contain a stop string that was not found
        # before, so the search is O(len(text) + longest stop string). The stop string that
        # completes first wins (ties: the longer one), so the result does not depend on how
        # the text was split into steps.
        first_end, first_at, first_stop = len(buf), len(buf), None
        for stop in self._stops:
            at = buf.find(stop, 0, first_end)
            if at != -1 and (at + len(stop) < first_end or at < first_at):
                first_end, first_at, first_stop = at + len(stop), at, stop
        if first_stop is not None:
            self.matched = first_stop
            self._held = ""
            return buf[:first_at]
        keep = self._partial_match_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the request: release the held-back tail (it never became a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for length in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
