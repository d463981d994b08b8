"""`KVBlockManager`: one worker's paged KV pool as the scheduler accounts for it.

Owns block ids, reference counts, per-request block tables and the prefix cache (hash-chained
full blocks). It never decides who runs (scheduler.py) and never touches tensors (the worker).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.scheduler.block_hash import BlockHash, request_block_hashes
from services.scheduler.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Held:
    """One request's block table, and how many of its leading blocks `cache_blocks` visited."""

    __slots__ = ("block_ids", "num_visited")

    def __init__(self, num_visited: int) -> None:
        self.block_ids: list[int] = []
        self.num_visited = num_visited


class KVBlockManager:
    """Block accounting and prefix caching for one worker's KV pool.

    Invariants (checked by `check_invariants`, asserted by the test harness every step):
      * every block is either free (ref_cnt == 0, in the free queue) or used (ref_cnt > 0,
        in >= 1 block table); ref_cnt[b] == number of block tables that hold b.
      * free + used == num_blocks; a block id appears at most once per table.
      * `_cached[h] == b` iff `_block_hash[b] == h`: a block is in the prefix cache under at
        most one hash, and a hash names at most one block.
      * NOTE: a block enters the cache only after every slot in it holds computed KV, as
        confirmed by the worker's step outputs (`cache_blocks` gets the confirmed count), so a
        cached block's content never changes: the worker writes KV in round order and
        nothing writes a position twice within one request incarnation.
      * free queue order is eviction order: uncached free blocks sit at the front (reused
        first), cached free blocks follow, least recently freed first (LRU). A request's
        blocks are freed tail first, so its prefix outlives its suffix.

    Args:
        num_blocks: blocks in the worker's pool.
        block_size: tokens per block.
        enable_prefix_caching: share full computed blocks between requests by hash.

    Attributes:
        ref_cnt: holders per block id.
        num_query_tokens / num_hit_tokens: prefix-cache lookups at admission, in tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"{block_size=} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt: list[int] = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._held: dict[str, _Held] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # ---- queries ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (free, including evictable cached ones)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block_table(self, request_id: str) -> list[int]:
        held = self._held.get(request_id)
        return held.block_ids if held is not None else []

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._held

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks of the request's longest cached prefix, and the tokens they cover.

        NOTE: the hit is capped at num_tokens - 1, rounded down to a block boundary: the last
        token is always computed so that it can sample (a request is never scheduled with
        zero new tokens, the crash of vLLM PR 11895). No side effects.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        cached = self._cached
        for h in request_block_hashes(request, self.block_size, max_blocks)[:max_blocks]:
            block = cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                     computed_blocks: Sequence[int] = ()) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, num_lookahead_tokens,
                                       computed_blocks) <= self._num_free_after_touch(computed_blocks)

    # ---- mutations ----

    def allocate_slots(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       computed_blocks: Sequence[int] | None = None) -> list[int] | None:
        """Give the request blocks for every slot the next round writes; None if they don't fit.

        `computed_blocks` (from `get_computed_blocks`) is passed once, at (re)admission.

        ```
        block table:  | cached (hit) | already held      | new blocks appended here     |
        tokens:       |<- computed_blocks ->|<- num_computed ->|<- num_new ->|<- lookahead ->|
                      0              hit    request.num_computed_tokens
        slots needed = hit + num_computed + num_new + lookahead   (hit only at admission,
                       where num_computed is 0)
        blocks added = cdiv(slots needed, block_size) - blocks already in the table
        ```
        Lookahead slots are for multi-step decoding: steps 1..n-1 of a round write one more
        position each without asking the scheduler.
        """
        held = self._held.get(request.request_id)
        if computed_blocks is None and held is not None:  # fast path: a running request grows
            num_needed = (_cdiv(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                                self.block_size) - len(held.block_ids))
            if num_needed <= 0:
                return []
            if num_needed > len(self._free):
                return None
            added = [self._pop_free() for _ in range(num_needed)]
            held.block_ids.extend(added)
            return added
        computed = computed_blocks if computed_blocks is not None else ()
        assert computed_blocks is None or (request.num_computed_tokens == 0 and held is None)
        num_needed = self._num_blocks_needed(request, num_new_tokens, num_lookahead_tokens, computed)
        if num_needed > self._num_free_after_touch(computed):
            return None
        if held is None:
            held = self._held[request.request_id] = _Held(len(computed))
        if computed_blocks is not None:
            self.num_query_tokens += request.num_tokens
            self.num_hit_tokens += len(computed) * self.block_size
        added: list[int] = []
        for block in computed:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1
            added.append(block)
        added.extend(self._pop_free() for _ in range(num_needed))
        held.block_ids.extend(added)
        return added

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is confirmed computed.

        `num_computed_tokens` must be confirmed by the worker's outputs, not the optimistic
        count. A block whose hash is already cached (another request computed the same
        prefix) stays uncached: the first copy serves future hits.
        """
        if not self.enable_prefix_caching:
            return
        held = self._held.get(request.request_id)
        if held is None:
            return
        table = held.block_ids
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = held.num_visited
        if num_full <= start:
            return
        hashes = request_block_hashes(request, self.block_size, num_full)
        for i in range(start, num_full):
            block, h = table[i], hashes[i]
            if self._block_hash[block] is None and h not in self._cached:
                self._block_hash[block] = h
                self._cached[h] = block
        held.num_visited = num_full

    def free(self, request: Request) -> None:
        """Drop the request's block table; its cached blocks stay reusable until evicted."""
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        for block in reversed(held.block_ids):  # tail first: the prefix is evicted last
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None
                if self._block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def reset_stats(self) -> None:
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # ---- helpers ----

    def _num_blocks_needed(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int,
                           computed: Sequence[int]) -> int:
        num_slots = (len(computed) * self.block_size + request.num_computed_tokens
                     + num_new_tokens + num_lookahead_tokens)
        held = self._held.get(request.request_id)
        num_held = (len(held.block_ids) if held is not None else 0) + len(computed)
        return _cdiv(num_slots, self.block_size) - num_held

    def _num_free_after_touch(self, computed: Sequence[int]) -> int:
        # Cached blocks with no holder sit in the free queue; touching them takes them out.
        return len(self._free) - sum(1 for b in computed if self.ref_cnt[b] == 0)

    def _pop_free(self) -> int:
        """Take the next block in eviction order, dropping its cache entry."""
        block = self._free.popitem(last=False)[0]
        h = self._block_hash[block]
        if h is not None:
            self._block_hash[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
        self.ref_cnt[block] = 1
        return block

    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant in the class docstring does not hold."""
        holders = [0] * self.num_blocks
        for request_id, held in self._held.items():
            table = held.block_ids
            assert len(set(table)) == len(table), f"{request_id} holds a block twice: {table}"
            for block in table:
                holders[block] += 1
        assert holders == self.ref_cnt, "ref counts differ from the number of holders"
        free = set(self._free)
        assert len(free) == len(self._free)
        used = {b for b in range(self.num_blocks) if self.ref_cnt[b] > 0}
        assert not (free & used), f"blocks both free and used: {sorted(free & used)}"
        assert len(free) + len(used) == self.num_blocks, "blocks leaked"
        for h, block in self._cached.items():
            assert self._block_hash[block] == h, f"cache entry for block {block} is stale"
        assert sum(h is not None for h in self._block_hash) == len(self._cached)
