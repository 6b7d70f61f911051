"""Regressions (manager machine, long randomized runs): under write-through a parent's host
copy was evicted while its child's copy was still flying to the host, and the child landed
behind a parent no tier had (or the device later evicted the parent as if the host had it).

Now an in-flight write-through holds the host copies of its chain's other keys until it lands,
and a device victim whose host copy is gone is written back (as under WRITE_BACK): a parent
leaves the device only for the host."""
from __future__ import annotations

from fastkv.cache.copies import Purpose
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy

BS = 2


def manager(dev: int, host: int) -> CacheManager:
    return CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS,
                                    policy=WritePolicy.WRITE_THROUGH))


def test_a_parent_on_the_host_is_held_while_its_childs_write_through_flies():
    m = manager(dev=4, host=2)
    a = [1, 2, 3, 4]  # blocks P (root) and C
    m.allocate("a", a)
    (p_copy,) = m.mark_computed("a", 2)
    m.complete(p_copy, True)  # P on the host
    (c_copy,) = m.mark_computed("a", 4)  # C on its way
    m.free("a")
    parent, child = m.keys_for(a)
    m.allocate("b", [7, 8])
    before = m.stats.skipped_copies
    assert m.mark_computed("b", 2) == []  # the host's one evictable block was P's: held, so b's copy is skipped
    assert m.stats.skipped_copies == before + 1 and parent in m.host.lookup
    m.check_integrity()
    # C lands and the hold on P ends: b's skipped copy is made now, into C's block (leaves go first)
    (late,) = m.complete(c_copy, True).plans
    assert m.stats.late_copies == 1 and late.kind is CopyKind.SWAP_OUT and list(late.src) == list(m.block_table("b"))
    assert parent in m.host.lookup and child not in m.host.lookup
    m.check_integrity()
    m.complete(late, True)
    assert m.keys_for([7, 8])[0] in m.host.lookup and m.host.num_available == 2, "nothing is held any more"
    m.check_integrity()


def parent_evicted_from_the_host(a: list[int]) -> tuple[CacheManager, bytes, bytes]:
    """Request "a" (blocks P, C) found P on the device, computed by request "a0" before it; two
    more write-throughs then filled the 2-block host tier, the second evicting P there. (Once
    "a" makes a write-through it holds its chain's host copies: P had to go before that.)"""
    m = manager(dev=4, host=2)
    m.allocate("a0", a[:2])
    (p_copy,) = m.mark_computed("a0", 2)
    m.complete(p_copy, True)
    m.free("a0")
    assert m.allocate("a", a).num_cached_tokens == 2
    parent, child = m.keys_for(a)
    for rid, toks in (("x", [7, 8]), ("y", [9, 10])):
        m.allocate(rid, toks)
        (copy,) = m.mark_computed(rid, 2)
        m.complete(copy, True)
        m.free(rid, cache=False)  # its host copy stays, cached; its device block is free again
    assert parent not in m.host.lookup and parent in m.device.lookup
    return m, parent, child


def test_a_parent_whose_host_copy_was_evicted_is_written_back_when_the_device_evicts_it():
    a = [1, 2, 3, 4]
    m, parent, child = parent_evicted_from_the_host(a)
    (c_copy,) = m.mark_computed("a", 4)  # C flies with no parent on the host to hold
    m.complete(c_copy, True)
    m.free("a")
    assert child in m.host.lookup
    assert m.allocate("z", [11, 12, 13, 14, 15]).plans == ()  # the two free blocks and C's (C is on the host)
    got = m.allocate("w", [16])  # the device's last cached block: P
    back = [p for p in got.plans if m.copies.records[p.plan_id].purpose is Purpose.WRITE_BACK]
    assert [p.kind for p in back] == [CopyKind.SWAP_OUT] and not got.ready
    assert m.copies.records[back[0].plan_id].keys == [parent]
    for p in got.plans:
        m.complete(p, True)
    assert m.is_ready("w")
    assert len(m.match(a + [0]).host_blocks) == 2, "P and C reachable from the root (P written back)"
    m.check_integrity()


def test_a_parent_that_reached_the_host_outside_the_hold_is_queued_behind_its_child():
    """The landing plan held no parent (P was on neither the host nor its way there when its
    request let go of its blocks and handed the plan a hold of its own); P's write-back lands
    first, then C. The host's order is then not the one the plan's unpins and releases make, so
    the landing refreshes the whole chain: one host eviction takes the leaf C, not P."""
    a = [1, 2, 3, 4]
    m, parent, child = parent_evicted_from_the_host(a)
    (c_copy,) = m.mark_computed("a", 4)
    rec = m.copies.records[c_copy.plan_id]
    assert rec.held is None and rec.owner is not None, "the request's own hold covers it"
    m.free("a")
    assert rec.held == [] and rec.owner is None
    got = m.allocate("z", [11, 12, 13, 14, 15])  # the two free blocks, and P from the device: written back
    assert [m.copies.records[p.plan_id].keys for p in got.plans] == [[parent]]
    for p in got.plans:
        m.complete(p, True)
    m.complete(c_copy, True)
    assert parent in m.host.lookup and child in m.host.lookup
    m.allocate("w", [20, 21])
    assert len(m.mark_computed("w", 2)) == 1  # its write-through evicts one host block
    assert parent in m.host.lookup and child not in m.host.lookup
    m.check_integrity()


def test_a_chain_let_go_of_during_its_write_through_is_queued_leaves_first_on_the_device():
    """The request frees its blocks while C's write-through flies: P goes back to the device's
    queue at once, C when the copy lands (after P). The landing refreshes the chain so that the
    device evicts C, the leaf, before P."""
    m = manager(dev=2, host=4)
    a = [1, 2, 3, 4]
    m.allocate("a", a)
    (p_copy,) = m.mark_computed("a", 2)
    m.complete(p_copy, True)
    (c_copy,) = m.mark_computed("a", 4)
    m.free("a")
    m.complete(c_copy, True)
    parent, child = m.keys_for(a)
    m.allocate("z", [9, 10])  # one device block: the queue's oldest goes
    assert parent in m.device.lookup and child not in m.device.lookup
    m.check_integrity()


def test_a_running_chain_skips_the_device_refresh_and_keeps_its_order():
    """While the request holds its blocks none of its chain is queued on the device: the
    landing leaves the device queue as it was."""
    m = manager(dev=4, host=4)
    m.allocate("old", [5, 6])
    for copy in m.mark_computed("old", 2):
        m.complete(copy, True)
    m.free("old")  # one cached block, queued
    m.allocate("a", [1, 2, 3, 4])
    for copy in m.mark_computed("a", 4):
        m.complete(copy, True)
    assert list(m.device.evictable) == [m.device.lookup[m.keys_for([5, 6])[0]]]
    m.check_integrity()
