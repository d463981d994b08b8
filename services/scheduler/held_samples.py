"""`HeldSamples`: later samples of n > 1 requests, held until their group's prompt is cached.

Why hold them: the frontend sends an n > 1 request as n requests, each naming the first one
in `shares_prompt_with`. Admitted together, all n would miss the prefix cache (a block enters
it only once the worker confirmed its KV) and compute the prompt n times. Held back until the
first sample has sampled its first token, which proves its whole prompt computed and puts the
prompt's full blocks in the cache, the others are admitted on the same worker and share those
blocks by reference count; each computes only the last partial block (and the last token,
which must be computed to sample). That is vLLM's fork without a block copy: the blocks that
could diverge are never shared, so nothing needs copy-on-write.

A held sample is released early, to compute on its own, when the first one is preempted,
finishes or fails before it sampled. Without prefix caching nothing is held: the samples run
side by side (each computes the prompt), correct and slower, as vLLM does.
"""

from __future__ import annotations

from services.scheduler.request import Request


class HeldSamples:
    """Samples waiting for another request (the group's first sample) to have computed the prompt."""

    def __init__(self) -> None:
        self._by_leader: dict[str, list[Request]] = {}
        self._leader_of: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._leader_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leader_of

    def hold(self, request: Request, leader_id: str) -> None:
        self._by_leader.setdefault(leader_id, []).append(request)
        self._leader_of[request.request_id] = leader_id

    def release(self, leader_id: str) -> list[Request]:
        """The samples held for `leader_id`, in arrival order; they are no longer held."""
        released = self._by_leader.pop(leader_id, [])
        for request in released:
            del self._leader_of[request.request_id]
        return released

    def remove(self, request_id: str) -> bool:
        """Forget a held sample (aborted); False if it was not held."""
        leader_id = self._leader_of.pop(request_id, None)
        if leader_id is None:
            return False
        group = self._by_leader[leader_id]
        group[:] = [r for r in group if r.request_id != request_id]
        if not group:
            del self._by_leader[leader_id]
        return True
