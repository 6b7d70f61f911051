"""Leaves first in every tier, by construction: a block is evicted from a tier only once no
keyed child of it is left in that tier, whatever order parent and child reached it in.

The regression: under write-through, 7 device blocks, 3 host blocks and no storage, a parent
and its child reach the host in separate plans, parent first, so the parent is the older entry
of the host's LRU queue; once the device has evicted the parent, the host evicted it before
the child, and the child stayed CACHED on the device and the host behind a parent no tier had.
"""
from __future__ import annotations

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.pool import BlockPool
from fastkv.cache.write_policy import WritePolicy

BS = 2


def stranded(m: CacheManager) -> list[bytes]:
    """Keyed device or host keys whose parent no tier has (nor a copy bringing it)."""
    present = set(m.device.lookup) | set(m.host.lookup) | set(m.index.stored)
    out = []
    for toks in m.test_chains:
        keys = m.keys_for(toks)
        for parent, child in zip(keys, keys[1:], strict=False):
            if (child in m.device.lookup or child in m.host.lookup) and parent not in present:
                out.append(child)
    return out


def test_a_parent_that_reached_the_host_first_is_not_evicted_before_its_child():
    m = CacheManager(CacheConfig(num_device_blocks=7, num_host_blocks=3, block_size=BS,
                                 policy=WritePolicy.WRITE_THROUGH))
    a = [1, 2, 3, 4, 5]  # blocks P (root) and C, and a partial one
    m.test_chains = [a]
    parent, child = m.keys_for(a)
    m.allocate("a", a)
    (p_copy,) = m.mark_computed("a", 2)  # P to the host: one plan
    m.complete(p_copy, True)
    (c_copy,) = m.mark_computed("a", 4)  # C to the host: a later plan
    m.free("a")  # P cached on both tiers; C's copy flies
    m.allocate("flood", list(range(100, 112)))  # six fresh blocks: the device evicts P (the host has it)
    m.free("flood", cache=False)
    assert parent not in m.device.lookup and parent in m.host.lookup
    m.complete(c_copy, True)  # C lands: CACHED on the device and the host
    m.check_integrity()
    assert child in m.device.lookup and child in m.host.lookup
    # two fresh blocks written through take the host's free block and evict one cached entry
    m.allocate("b", [50, 51, 52, 53])
    for plan in m.mark_computed("b", 4):
        m.complete(plan, True)
    m.check_integrity()
    assert stranded(m) == [], "a cached child is stranded behind a parent no tier has"
    assert parent in m.host.lookup, "the host evicted the parent before its child"


def pool_with_chain(order: str) -> tuple[BlockPool, int, int]:
    """A 3-block pool whose parent P and child C were keyed in separate calls, ``order`` giving
    which one became CACHED first (the older entry of the queue)."""
    pool = BlockPool("host", 3)
    pool.parents.update({b"C": b"P"})
    p, c = pool.take(), pool.take()
    pool.set_key(p, b"P")
    pool.set_key(c, b"C")
    for b in ([p, c] if order == "parent first" else [c, p]):
        pool.release(b)
    return pool, p, c


def test_a_parent_older_than_its_child_in_the_queue_is_evicted_after_it():
    for order in ("parent first", "child first"):
        pool, p, c = pool_with_chain(order)
        evicted: list[tuple[int, bytes]] = []
        pool.take_many(2, evicted)  # the free block, then one victim
        assert [k for _, k in evicted] == [b"C"], order
        pool.check_integrity()
        pool.take(evicted)
        assert [k for _, k in evicted] == [b"C", b"P"] and pool.kids == {}
        assert pool.forced_evictions == 0


def test_a_child_on_its_way_to_the_tier_keeps_its_parent_there():
    pool = BlockPool("host", 2)
    pool.parents.update({b"C": b"P"})
    p = pool.take()
    pool.set_key(p, b"P")
    pool.release(p)
    parents = pool.expect([b"C"])  # a copy brings C
    dst = pool.take_pinned()  # the free block
    assert dst >= 0 and b"P" in pool.lookup
    other = pool.take()  # P's is the only block left: taken only when nothing else can be
    assert other == p and pool.forced_evictions == 1
    pool.unexpect(parents)
    pool.check_integrity()
