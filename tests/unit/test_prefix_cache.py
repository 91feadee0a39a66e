"""Hash chain and the LRU of cached-free blocks."""

from __future__ import annotations

from kvroom.engine.kv.prefix_cache import PrefixCache, chain_hashes, hash_block


def test_equal_prefixes_give_equal_hashes_and_a_change_moves_every_later_hash() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4, num_blocks=2)
    b = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0], block_size=4, num_blocks=2)
    c = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], block_size=4, num_blocks=2)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1], "block 1's hash covers block 0's tokens"
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    assert hash_block(None, [5, 6, 7, 8]) != a[1], "the same tokens after another parent"


def test_chain_hashes_extends_known_hashes() -> None:
    tokens = list(range(12))
    first = chain_hashes(tokens, 4, 1)
    assert chain_hashes(tokens, 4, 3, first) == chain_hashes(tokens, 4, 3)
    assert chain_hashes(tokens, 4, 0) == []


def test_token_ids_are_not_confused_across_byte_boundaries() -> None:
    assert hash_block(None, [1, 256]) != hash_block(None, [256, 1])
    assert hash_block(None, [70000]) != hash_block(None, [70000 % 65536])


def _cache_with(blocks: list[int]) -> PrefixCache:
    cache = PrefixCache()
    for b in blocks:
        assert cache.register(b, hash_block(None, [b]))
    return cache


def test_evicts_the_least_recently_freed_block_first() -> None:
    cache = _cache_with([3, 5, 7])
    for b in (5, 3, 7):
        cache.park(b)
    cache.unpark(3)  # hit: in use again
    cache.park(3)  # freed again: now the most recent
    assert list(cache.free_blocks()) == [5, 7, 3]
    assert cache.evict() == 5
    assert cache.find(hash_block(None, [5])) is None and cache.hash_of(5) is None
    assert (cache.num_free, cache.num_cached) == (2, 2)
    assert [cache.evict(), cache.evict(), cache.evict()] == [7, 3, None]


def test_a_duplicate_hash_stays_unregistered() -> None:
    cache = _cache_with([1])
    assert not cache.register(2, hash_block(None, [1]))
    assert cache.hash_of(2) is None and cache.find(hash_block(None, [1])) == 1


def test_reset_forgets_everything_and_returns_the_cached_free_blocks() -> None:
    cache = _cache_with([1, 2, 3])
    cache.park(2)
    assert cache.reset() == [2]
    assert (cache.num_free, cache.num_cached) == (0, 0)
    cache.check_invariants(used=set())


def test_remap_moves_hashes_with_their_blocks() -> None:
    cache = _cache_with([6, 1])
    cache.remap({6: 2})
    assert cache.find(hash_block(None, [6])) == 2 and cache.hash_of(6) is None
    cache.check_invariants(used={1, 2})
