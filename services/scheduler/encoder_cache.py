"""`EncoderCacheManager`: one worker's encoder cache as the scheduler accounts for it.

Entries are keyed by an image's content hash, so identical images in concurrent requests are
encoded once. A request holds an item from the round whose chunk first reaches the item's
placeholder range until the round that computes its last placeholder token (or until it is
preempted or finishes); an entry nobody holds is freed, and the free travels with the next
round, which the worker runs after every round that used the entry. A freed entry that a
request needs again before that round is sent is revived instead (an encoder-cache hit).

Per round, `EncoderRound` collects tentative decisions (items to encode, holds taken) so a
request taken out of the round again (preemption) is undone without touching the manager;
`commit` applies them once the round is fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.encoder_budget import EncoderBudget
from services.scheduler.request import Request
from shared.execute import MultiModalItem

HoldKey = tuple[str, int]  # (request id, item offset): one placeholder range of one request


@dataclass(slots=True)
class _Entry:
    num_tokens: int
    holders: set[HoldKey] = field(default_factory=set)


@dataclass(slots=True)
class EncoderRound:
    """Encoder decisions of the round under construction."""

    compute_left: int
    space_left: int
    to_encode: dict[str, int] = field(default_factory=dict)  # hash -> tokens, new this round
    revived: dict[str, int] = field(default_factory=dict)  # hash -> tokens, freed earlier, needed again
    holds: dict[str, list[tuple[str, HoldKey]]] = field(default_factory=dict)  # request id -> holds

    def undo(self, request_id: str) -> None:
        """Forget a request's tentative holds; encodes/revivals only it wanted are dropped too."""
        dropped = self.holds.pop(request_id, [])
        still = {h for holds in self.holds.values() for h, _ in holds}
        for h, _ in dropped:
            if h in still:
                continue
            if h in self.to_encode:
                tokens = self.to_encode.pop(h)
                self.compute_left += tokens
                self.space_left += tokens
            elif h in self.revived:
                self.space_left += self.revived.pop(h)


class EncoderCacheManager:
    """Budgeted encoder-cache accounting for one worker.

    Invariants (`check_invariants`, asserted by the scheduler harness every step):
      * used tokens == sum of live entries' tokens <= budget.cache_tokens;
      * every live entry has >= 1 holder; an entry with none is pending free, not live;
      * a hash is live or pending free, never both.
    """

    def __init__(self, budget: EncoderBudget) -> None:
        self.budget = budget
        self.entries: dict[str, _Entry] = {}
        self.pending_free: dict[str, int] = {}  # hash -> tokens; sent with the next round
        self.num_used_tokens = 0
        self.num_encoded = 0
        self.num_hits = 0  # items needed that were cached (or being encoded) already

    # ---- planning ----

    def begin_round(self) -> EncoderRound:
        return EncoderRound(self.budget.compute_tokens, self.budget.cache_tokens - self.num_used_tokens)

    def fit(self, plan: EncoderRound, request: Request, start: int, num_tokens: int) -> int:
        """How many of `num_tokens` from `start` the request may compute given the encoder budget.

        Every item whose placeholder range meets [start, start + n) must be cached or encoded
        in full this round. At the first item that fits neither budget the chunk stops before
        it; when that leaves nothing (the chunk starts inside the item, e.g. recomputing the
        last block of a prefix hit), the answer is 0 and the request waits. Never negative.
        """
        items = request.mm_items
        if not items or items[-1].end <= start:
            return num_tokens  # past its last image (every decode step)
        end = start + num_tokens
        request_id = request.request_id
        for item in items:
            if item.offset >= end:
                break
            if item.end <= start:
                continue
            key = (request_id, item.offset)
            entry = self.entries.get(item.hash)
            if entry is not None and key in entry.holders:
                continue  # held since an earlier chunk
            if not self._take(plan, item):
                return max(0, item.offset - start)
            plan.holds.setdefault(request_id, []).append((item.hash, key))
        return num_tokens

    def _take(self, plan: EncoderRound, item: MultiModalItem) -> bool:
        h = item.hash
        if h in self.entries or h in plan.to_encode or h in plan.revived:
            self.num_hits += 1
            return True
        if h in self.pending_free:
            if item.length > plan.space_left:
                return False
            plan.revived[h] = item.length
            plan.space_left -= item.length
            self.num_hits += 1
            return True
        if item.length > plan.compute_left or item.length > plan.space_left:
            return False
        plan.to_encode[h] = item.length
        plan.compute_left -= item.length
        plan.space_left -= item.length
        return True

    def commit(self, plan: EncoderRound) -> list[str]:
        """Apply the round's decisions; returns the hashes the worker must encode."""
        for h, tokens in plan.revived.items():
            del self.pending_free[h]
            self.entries[h] = _Entry(tokens)
            self.num_used_tokens += tokens
        for h, tokens in plan.to_encode.items():
            self.entries[h] = _Entry(tokens)
            self.num_used_tokens += tokens
        for holds in plan.holds.values():
            for h, key in holds:
                entry = self.entries.get(h)
                if entry is None:  # its other holders were preempted while the round was planned
                    entry = self.entries[h] = _Entry(self.pending_free.pop(h))
                    self.num_used_tokens += entry.num_tokens
                entry.holders.add(key)
        self.num_encoded += len(plan.to_encode)
        return list(plan.to_encode)

    # ---- releasing ----

    def release_passed(self, request: Request, computed_end: int) -> None:
        """The request's rounds sent so far compute up to `computed_end`: drop items it has passed."""
        for item in request.mm_items:
            if item.end > computed_end:
                break
            self._release(item.hash, (request.request_id, item.offset))

    def release_request(self, request: Request) -> None:
        """Preempted or finished: drop every hold (a recompute takes them again)."""
        for item in request.mm_items:
            self._release(item.hash, (request.request_id, item.offset))

    def _release(self, h: str, key: HoldKey) -> None:
        entry = self.entries.get(h)
        if entry is None or key not in entry.holders:
            return
        entry.holders.discard(key)
        if not entry.holders:
            del self.entries[h]
            self.num_used_tokens -= entry.num_tokens
            self.pending_free[h] = entry.num_tokens

    def take_frees(self) -> list[str]:
        """Hashes to free at the start of the next round sent."""
        frees = list(self.pending_free)
        self.pending_free.clear()
        return frees

    # ---- checks ----

    @property
    def usage(self) -> float:
        return self.num_used_tokens / self.budget.cache_tokens

    def check_invariants(self) -> None:
        assert self.num_used_tokens == sum(e.num_tokens for e in self.entries.values()), "used tokens drifted"
        assert self.num_used_tokens <= self.budget.cache_tokens, (
            f"encoder cache over budget: {self.num_used_tokens} > {self.budget.cache_tokens}")
        for h, entry in self.entries.items():
            assert entry.holders, f"live encoder entry {h} has no holder"
            assert h not in self.pending_free, f"{h} both live and pending free"
