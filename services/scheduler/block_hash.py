"""Prefix-cache block hashes: one 16-byte blake2b digest per full block, chained.

hash(block i) = blake2b(hash(block i-1) || token ids of block i || extra keys of block i), and
block 0 chains from a root derived from the request's salts (`cache_salts`, which apply to
the whole chain). A multimodal item's extra key is its content hash plus its offset, and it
enters exactly the blocks its placeholder range covers: text before an image still shares
blocks, an identical image at the same place shares them, a different image never does (and
neither does anything after it, through the chain). Equal hashes therefore mean equal token
prefixes with equal images at equal places. Pure functions; no state besides the request's
own `block_hashes` list, which only grows because a request's tokens only grow.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from services.scheduler.request import Request
from shared.execute import MultiModalItem

BlockHash = bytes

_DIGEST_SIZE = 16
_ROOT = hashlib.blake2b(b"spindle-prefix-cache-v1", digest_size=_DIGEST_SIZE).digest()


def root_hash(extra_keys: Sequence[str]) -> BlockHash:
    """The parent of block 0: salts that apply to the whole chain enter here.

    Multimodal items do not: they are positional (`block_extra_keys`), so an image taints only
    the blocks it covers and their descendants, not the text before it.
    """
    if not extra_keys:
        return _ROOT
    h = hashlib.blake2b(_ROOT, digest_size=_DIGEST_SIZE)
    for key in extra_keys:
        encoded = key.encode()
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    """Hash of one full block given its parent's hash (and the block's own extra keys)."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        encoded = key.encode()
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    return h.digest()


def block_extra_keys(items: Sequence[MultiModalItem], start: int, end: int) -> list[str]:
    """Keys of the items whose placeholder range meets tokens [start, end): hash@offset each."""
    return [f"{item.hash}@{item.offset}" for item in items if item.offset < end and start < item.end]


def request_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[BlockHash]:
    """`request.block_hashes`, extended to at least `num_blocks` full blocks (when known).

    Cost is proportional to the blocks not hashed before: O(changed) per step.
    """
    hashes = request.block_hashes
    limit = min(num_blocks, len(request.all_token_ids) // block_size)
    if len(hashes) >= limit:
        return hashes
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else root_hash(request.cache_salts)
    items = request.mm_items
    for i in range(len(hashes), limit):
        start, end = i * block_size, (i + 1) * block_size
        keys = block_extra_keys(items, start, end) if items else ()
        parent = hash_block(parent, tokens[start:end], keys)
        hashes.append(parent)
    return hashes
