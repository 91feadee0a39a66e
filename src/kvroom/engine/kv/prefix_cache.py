"""Automatic prefix caching: full blocks named by a hash chain of their tokens (torch-free).

A full block's hash covers every token before it, so equal hashes mean equal K/V (the model,
dtype and block size are fixed for the life of an engine)::

    tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    hashes:  h0 = H(-, t0..t3)   h1 = H(h0, t4..t7)      (the partial block has no hash)

Every registered block, used or free, is findable by its hash. A registered block whose last
user frees it is *cached-free*: it counts as free, but keeps its K/V and its hash in an LRU
until a free block is needed and none without a hash is left (then the least recently freed
one is evicted). A later sequence whose chain hits it takes it back without recomputing.

Prompts whose K/V depends on more than token ids (images behind placeholder tokens) are not
hashed: the scheduler keeps them out of the cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

BlockHash = bytes
"""SHA-256 digest of (parent hash, block token ids)."""

_ROOT = b"kvroom-prefix-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block: ``sha256(parent or root, token ids as int64)``."""
    digest = hashlib.sha256(parent or _ROOT)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, known: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``, reusing ``known``.

    Args:
        token_ids: the sequence's tokens (at least ``num_blocks * block_size`` of them).
        block_size: tokens per block.
        num_blocks: how many leading full blocks to hash.
        known: hashes already computed for the leading blocks (a prefix of the result).
    """
    assert len(token_ids) >= num_blocks * block_size, "chain_hashes past the tokens"
    hashes = list(known[:num_blocks])
    for i in range(len(hashes), num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


class PrefixCache:
    """Hash <-> block for every registered block, and the LRU of cached-free ones.

    It never decides who holds a block (that is ``BlockManager``'s refcount); it answers
    "which block has this hash", "is this block cached", and "which cached-free block goes
    first".
    """

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        """Cached-free blocks, least recently freed first."""
        self.num_query_tokens = 0
        """Prompt tokens looked up since start (vLLM's ``prefix_cache_queries``)."""
        self.num_hit_tokens = 0
        """Of those, tokens whose K/V came from the cache (vLLM's ``prefix_cache_hits``)."""

    @property
    def num_free(self) -> int:
        """Cached-free blocks (free, but holding reusable K/V)."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Registered blocks, used or free."""
        return len(self._hash_of)

    def find(self, block_hash: BlockHash) -> int | None:
        return self._by_hash.get(block_hash)

    def longest_prefix(
        self, token_ids: Sequence[int], block_size: int, max_blocks: int
    ) -> tuple[list[int], list[BlockHash]]:
        """Blocks (and their hashes) of the longest cached chain of ``token_ids``' leading
        full blocks, at most ``max_blocks``; hashing stops at the first miss."""
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        for i in range(max_blocks):
            parent = hashes[-1] if hashes else None
            block_hash = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
            hashes.append(block_hash)
        return blocks, hashes

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def free_blocks(self) -> Iterator[int]:
        """Cached-free blocks, least recently freed first."""
        return iter(self._lru)

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Name a just-computed full block; False when the hash already names another one.

        A duplicate (two sequences computed the same block at once) stays unregistered, so
        each hash names exactly one block.
        """
        assert block not in self._hash_of, f"block {block} is already registered"
        if block_hash in self._by_hash:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def park(self, block: int) -> None:
        """A registered block lost its last user: it becomes the most recently freed."""
        assert block in self._hash_of and block not in self._lru, f"park({block})"
        self._lru[block] = None

    def unpark(self, block: int) -> None:
        """A cached-free block was hit: it is in use again."""
        del self._lru[block]

    def evict(self) -> int | None:
        """Forget the least recently freed block and return it (None when there is none)."""
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        self.drop(block)
        return block

    def drop(self, block: int) -> None:
        """Forget ``block``'s hash (and its LRU place, if it is cached-free)."""
        self._lru.pop(block, None)
        del self._by_hash[self._hash_of.pop(block)]

    def reset(self) -> list[int]:
        """Forget every hash; returns the cached-free blocks, which become plainly free."""
        freed = list(self._lru)
        self._by_hash.clear()
        self._hash_of.clear()
        self._lru.clear()
        return freed

    def remap(self, mapping: Mapping[int, int]) -> None:
        """Blocks moved (a pool shrink): ``mapping[src] = dst`` for used blocks only."""
        for src, dst in mapping.items():
            block_hash = self._hash_of.pop(src, None)
            if block_hash is not None:
                assert src not in self._lru, f"a cached-free block {src} was moved"
                self._hash_of[dst] = block_hash
                self._by_hash[block_hash] = dst

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup (tokens asked, tokens found)."""
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def check_invariants(self, used: set[int]) -> None:
        """Assert the two maps mirror each other and cached-free blocks are not in use."""
        assert len(self._by_hash) == len(self._hash_of), "hash maps disagree in size"
        for block, block_hash in self._hash_of.items():
            assert self._by_hash[block_hash] == block, f"block {block}'s hash names another"
        assert set(self._lru) <= self._hash_of.keys(), "an unregistered block is cached-free"
        assert not set(self._lru) & used, f"cached-free blocks in use: {set(self._lru) & used}"
