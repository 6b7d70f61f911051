import pytest

from fastkv.cache.pool import BlockPool, BlockState


def test_take_order_cache_and_evict_lru_first():
    p = BlockPool("device", 4)
    assert [p.take() for _ in range(4)] == [0, 1, 2, 3]
    for b, k in zip(range(4), (b"a", b"b", b"c", b"d"), strict=True):
        assert p.set_key(b, k)
    for b in (2, 0, 3, 1):
        p.release(b)
    assert list(p.evictable) == [2, 0, 3, 1] and p.num_cached == 4 and p.num_free == 0
    evicted = []
    assert p.take_many(2, evicted) == [2, 0]
    assert evicted == [(2, b"c"), (0, b"a")]
    assert p.lookup == {b"b": 1, b"d": 3}
    p.check_integrity()


def test_freed_unkeyed_blocks_are_reused_before_cached_ones():
    p = BlockPool("device", 3)
    a, b, c = p.take_many(3)
    p.set_key(a, b"k")
    p.release(a)
    p.release(b)
    assert p.take() == b  # FREE before evicting the CACHED one
    assert p.block_state(a) is BlockState.CACHED
    p.check_integrity()


def test_hit_takes_a_cached_block_out_of_the_lru():
    p = BlockPool("device", 2)
    b = p.take()
    p.set_key(b, b"k")
    p.release(b)
    p.incref(p.lookup[b"k"])
    assert p.block_state(b) is BlockState.ALLOCATED and b not in p.evictable
    p.incref(b)
    p.release(b)
    p.release(b)
    assert p.block_state(b) is BlockState.CACHED
    with pytest.raises(ValueError, match="double free"):
        p.release(b)


def test_in_flight_blocks_are_never_handed_out_evicted_or_freed():
    p = BlockPool("host", 2)
    b = p.take()
    p.set_key(b, b"k")
    p.pin(b)
    p.release(b)  # the holder leaves; the copy still reads it
    assert p.block_state(b) is BlockState.IN_FLIGHT
    with pytest.raises(ValueError, match="IN_FLIGHT"):
        p.evict(b)
    other = p.take()
    assert other != b and p.take() is None
    p.unpin(b)
    assert p.block_state(b) is BlockState.CACHED
    with pytest.raises(ValueError, match="not in flight"):
        p.unpin(b)
    p.check_integrity()


def test_take_pinned_block_keyed_only_after_success():
    p = BlockPool("host", 1)
    b = p.take_pinned()
    assert p.block_state(b) is BlockState.IN_FLIGHT and p.ref[b] == 0
    p.unpin(b)  # a failed copy: no key, back to FREE
    assert p.block_state(b) is BlockState.FREE and not p.lookup
    b = p.take_pinned()
    assert p.set_key(b, b"x")
    p.unpin(b)
    assert p.block_state(b) is BlockState.CACHED


def test_duplicate_keys_and_bad_ids():
    p = BlockPool("device", 3)
    a, b = p.take_many(2)
    assert p.set_key(a, b"k") and not p.set_key(b, b"k")
    assert p.insert_many([b], [b"k"]) == [0] and p.key[b] is None
    with pytest.raises(ValueError, match="out of range"):
        p.pin(3)
    with pytest.raises(ValueError, match="out of range"):
        p.block_state(-1)
    with pytest.raises(ValueError, match="available"):
        p.take_many(5)
    with pytest.raises(ValueError, match="FREE"):
        p.incref(2)
    with pytest.raises(ValueError, match="already has a key"):
        p.set_key(a, b"z")
    p.check_integrity()


def test_release_without_keep_drops_the_key_and_clear():
    p = BlockPool("device", 2)
    a, b = p.take_many(2)
    p.set_key(a, b"a")
    p.set_key(b, b"b")
    p.release(a, keep=False)
    p.release(b)
    assert p.block_state(a) is BlockState.FREE and p.lookup == {b"b": b}
    assert p.clear() == [b"b"] and p.num_free == 2
    p.check_integrity()
