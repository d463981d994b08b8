"""Prefix caching with images: an image's hash@offset keys exactly the blocks it covers.

Identical images at the same place share blocks; a different image never does (nor anything
after it); text before the image still shares; a salt still separates whole chains.
"""

from __future__ import annotations

from services.scheduler.block_hash import request_block_hashes
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.request import Request
from shared.execute import MultiModalItem

BS = 4
PLACEHOLDER = 9


def request(request_id: str, image_hash: str | None, offset: int = 6, salts: tuple[str, ...] = ()) -> Request:
    """20 tokens: text, an 8-token image at `offset` (blocks 1..3 at offset 6), text."""
    tokens = list(range(20, 40))
    items: tuple[MultiModalItem, ...] = ()
    if image_hash is not None:
        tokens[offset : offset + 8] = [PLACEHOLDER] * 8
        items = (MultiModalItem(image_hash, offset, 8),)
    return Request(request_id=request_id, prompt_token_ids=tokens, mm_items=items, cache_salts=salts)


def hashes(r: Request) -> list[bytes]:
    return list(request_block_hashes(r, BS, 5))


def test_identical_image_at_the_same_place_shares_every_block() -> None:
    assert hashes(request("a", "cat")) == hashes(request("b", "cat"))


def test_different_image_shares_only_the_text_before_it() -> None:
    cat, dog = hashes(request("a", "cat")), hashes(request("b", "dog"))
    assert cat[0] == dog[0]  # block 0 is text only
    assert all(c != d for c, d in zip(cat[1:], dog[1:], strict=True))  # blocks 1-3 hold the image; 4 follows it


def test_image_keys_only_the_blocks_it_covers() -> None:
    # Same tokens, same image, image placed at 8 instead of 6: block 1 ([4, 8)) is then text
    # in one prompt and image in the other, so they part there; block 0 still shares.
    at6, at8 = hashes(request("a", "cat", 6)), hashes(request("b", "cat", 8))
    assert at6[0] == at8[0] and at6[1] != at8[1]


def test_salt_still_separates_whole_chains() -> None:
    plain, salted = hashes(request("a", "cat")), hashes(request("b", "cat", salts=("tenant-1",)))
    assert all(p != s for p, s in zip(plain, salted, strict=True))


def test_kv_block_manager_hits_follow_the_images() -> None:
    kv = KVBlockManager(32, BS)
    first = request("first", "cat")
    blocks = kv.allocate_slots(first, 20, computed_blocks=[])
    assert blocks is not None
    kv.cache_blocks(first, 20)
    same, other, text = request("same", "cat"), request("other", "dog"), request("text", None)
    assert kv.get_computed_blocks(same)[1] == 16  # all full blocks but the last token's
    assert kv.get_computed_blocks(other)[1] == 4  # the text before the image
    assert kv.get_computed_blocks(text)[1] == 4  # text-only prompt with the same first block
