"""KVBlockManager: allocation, ref counts, the hash-chained prefix cache, eviction order."""

from __future__ import annotations

from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.request import Request

BS = 4


def _make_block_manager(num_blocks: int = 16, block_size: int = BS, caching: bool = True) -> KVBlockManager:
    return KVBlockManager(num_blocks, block_size, enable_prefix_caching=caching)


def _request(request_id: str, tokens: list[int], salts: tuple[str, ...] = ()) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(tokens), cache_salts=salts)


def _admit_and_compute(kv: KVBlockManager, request: Request) -> list[int]:
    """Admit with any prefix hit, compute the whole prompt, confirm it (as the worker would)."""
    computed, num_hit = kv.get_computed_blocks(request)
    blocks = kv.allocate_slots(request, request.num_tokens - num_hit, 0, computed)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_tokens)
    kv.check_invariants()
    return kv.block_table(request.request_id)


def test_allocate_and_free_return_every_block() -> None:
    kv = _make_block_manager(8)
    a = _request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.check_invariants()
    kv.free(a)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = _make_block_manager(2)
    a = _request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is None
    assert kv.num_free_blocks == 2 and not kv.has_blocks("a")
    assert not kv.can_allocate(a, 12) and kv.can_allocate(a, 8)


def test_lookahead_slots_get_blocks_for_multi_step() -> None:
    kv = _make_block_manager(8)
    a = _request("a", list(range(7)))
    kv.allocate_slots(a, 7)
    a.num_computed_tokens = 7
    # One decode token now plus 4 lookahead positions: slots 7..11 -> blocks 1 (have) and 2 (new).
    assert kv.allocate_slots(a, 1, 4) == [2]
    assert kv.allocate_slots(a, 1, 0) == []  # already covered


def test_shared_prefix_is_reused_and_ref_counted() -> None:
    kv = _make_block_manager(16)
    a = _request("a", list(range(10)))
    a_table = _admit_and_compute(kv, a)
    b = _request("b", [*range(8), 99, 98, 97])
    computed, num_hit = kv.get_computed_blocks(b)
    assert computed == a_table[:2] and num_hit == 8
    kv.allocate_slots(b, b.num_tokens - num_hit, 0, computed)
    assert kv.ref_cnt[a_table[0]] == 2 and kv.ref_cnt[a_table[1]] == 2 and kv.ref_cnt[a_table[2]] == 1
    assert kv.num_query_tokens == 21 and kv.num_hit_tokens == 8
    kv.check_invariants()
    kv.free(a)
    assert kv.ref_cnt[a_table[0]] == 1
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == 16


def test_hash_chain_needs_the_whole_prefix() -> None:
    kv = _make_block_manager(16)
    _admit_and_compute(kv, _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit at all.
    assert kv.get_computed_blocks(_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0
    assert kv.get_computed_blocks(_request("c", [1, 2, 3, 4, 5, 6, 7, 0, 9]))[1] == 4


def test_extra_keys_change_hashes() -> None:
    kv = _make_block_manager(16)
    tokens = list(range(9))
    _admit_and_compute(kv, _request("a", tokens, salts=("image-1",)))
    assert kv.get_computed_blocks(_request("b", tokens, salts=("image-2",)))[1] == 0
    assert kv.get_computed_blocks(_request("c", tokens))[1] == 0
    assert kv.get_computed_blocks(_request("d", tokens, salts=("image-1",)))[1] == 8


def test_last_prompt_token_is_always_computed() -> None:
    kv = _make_block_manager(16)
    _admit_and_compute(kv, _request("a", list(range(8))))
    # Fully cached, block-aligned prompt: the hit stops one block short so a token is left to sample.
    computed, num_hit = kv.get_computed_blocks(_request("b", list(range(8))))
    assert num_hit == 4 and len(computed) == 1
    assert kv.get_computed_blocks(_request("c", list(range(9))))[1] == 8


def test_identical_block_aligned_requests_recompute_last_block_into_a_new_block() -> None:
    """Regression for vLLM PR 11895: two identical requests whose prompt ends on a block boundary.

    The second must get a positive number of new tokens (the last block recomputed), and the
    recomputed copy must not replace the cached block.
    """
    kv = _make_block_manager(16)
    a_table = _admit_and_compute(kv, _request("a", list(range(16))))
    b = _request("b", list(range(16)))
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12 and b.num_tokens - num_hit == 4
    kv.allocate_slots(b, b.num_tokens - num_hit, 0, computed)
    b_table = kv.block_table("b")
    assert b_table[:3] == a_table[:3] and b_table[3] != a_table[3]
    b.num_computed_tokens = 16
    kv.cache_blocks(b, 16)
    kv.check_invariants()
    assert kv.get_computed_blocks(_request("c", list(range(17))))[0] == a_table


def test_uncomputed_blocks_are_not_cached() -> None:
    kv = _make_block_manager(16)
    a = _request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12  # scheduled (optimistic), but the worker confirmed only 5
    kv.cache_blocks(a, 5)
    assert kv.num_cached_blocks == 1
    assert kv.get_computed_blocks(_request("b", list(range(13))))[1] == 4
    kv.cache_blocks(a, 12)
    assert kv.get_computed_blocks(_request("c", list(range(13))))[1] == 12


def test_partial_block_is_never_cached() -> None:
    kv = _make_block_manager(16)
    _admit_and_compute(kv, _request("a", list(range(6))))
    assert kv.num_cached_blocks == 1


def test_freed_cached_blocks_are_evicted_lru_tail_first_after_uncached_ones() -> None:
    kv = _make_block_manager(6)
    a = _request("a", [10, 11, 12, 13, 14, 15, 16, 17])
    b = _request("b", [20, 21, 22, 23, 24, 25, 26, 27, 28])
    a_table = _admit_and_compute(kv, a)  # blocks 0, 1 (both cached)
    b_table = _admit_and_compute(kv, b)  # blocks 2, 3 cached, 4 partial (uncached)
    kv.free(a)
    kv.free(b)
    # Eviction order: uncached (b's partial block, and never-used 5), then a (tail first), then b.
    c = _request("c", list(range(100, 124)))
    order = kv.allocate_slots(c, 24)
    assert order is not None
    assert set(order[:2]) == {b_table[2], 5}
    assert order[2:] == [a_table[1], a_table[0], b_table[1], b_table[0]]
    kv.check_invariants()
    assert kv.num_cached_blocks == 0


def test_eviction_keeps_recently_freed_prefix_available() -> None:
    kv = _make_block_manager(4)
    a = _request("a", list(range(9)))
    _admit_and_compute(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    # A 1-block allocation takes the uncached blocks first, so a's prefix survives.
    kv.allocate_slots(_request("x", [7, 7]), 2)
    assert kv.get_computed_blocks(_request("a2", list(range(9))))[1] == 8


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = _make_block_manager(3)
    a = _request("a", list(range(9)))
    _admit_and_compute(kv, a)
    kv.free(a)
    b = _request("b", list(range(9)))
    computed, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 3 free blocks, 2 of them are b's hits: exactly 1 left for the last token.
    assert kv.can_allocate(b, 1, 0, computed) and not kv.can_allocate(b, 5, 0, computed)
    assert kv.allocate_slots(b, 1, 0, computed) is not None
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_prefix_caching_disabled_never_hits() -> None:
    kv = _make_block_manager(16, caching=False)
    _admit_and_compute(kv, _request("a", list(range(9))))
    assert kv.get_computed_blocks(_request("b", list(range(9))))[1] == 0
    assert kv.num_cached_blocks == 0
