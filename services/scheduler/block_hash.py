"""Prefix-cache block hashes: one 16-byte blake2b digest per full block, chained.

hash(block i) = blake2b(hash(block i-1) || token ids of block i), and block 0 chains from a
root derived from the request's extra keys (`cache_salts`). Equal hashes therefore mean
equal token prefixes under equal extra keys. Pure functions; no state besides the request's
own `block_hashes` list, which only grows because a request's tokens only grow.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from services.scheduler.request import Request

BlockHash = bytes

_DIGEST_SIZE = 16
_ROOT = hashlib.blake2b(b"spindle-prefix-cache-v1", digest_size=_DIGEST_SIZE).digest()


def root_hash(extra_keys: Sequence[str]) -> BlockHash:
    """The parent of block 0. Extra keys (multimodal item hashes, salts) enter here.

    NOTE: the scheduler does not know where a multimodal item sits in the prompt, so its hash
    taints the whole chain: two prompts with different images share no block even if their
    text before the image matches. Conservative, never wrong.
    """
    if not extra_keys:
        return _ROOT
    h = hashlib.blake2b(_ROOT, digest_size=_DIGEST_SIZE)
    for key in extra_keys:
        encoded = key.encode()
        h.update(len(encoded).to_bytes(4, "little"))
        h.update(encoded)
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


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
    for i in range(len(hashes), limit):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
