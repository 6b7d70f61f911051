"""Regression (manager machine, long randomized run): under write-through, a parent's host copy
was evicted while its child's copy was still flying to the host; the device later evicted the
parent as if the host had it, and the child's host copy was left behind a parent in no tier.

Now a device victim whose host copy is gone is written back (as under WRITE_BACK): a parent
leaves the device only for the host. And a write-through that lands refreshes its chain leaves
first in both tiers (its device sources re-entered the LRU queue young when it unpinned them)."""
from __future__ import annotations

from fastkv.cache.copies import Purpose
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy

BS = 2


def test_a_parent_whose_host_copy_was_evicted_is_written_back_when_the_device_evicts_it():
    m = CacheManager(CacheConfig(num_device_blocks=4, num_host_blocks=2, block_size=BS,
                                 policy=WritePolicy.WRITE_THROUGH))
    a = [1, 2, 3, 4]  # blocks P (root) and C
    m.allocate("a", a)
    (p_copy,) = m.mark_computed("a", 2)
    m.complete(p_copy, True)  # P on the host
    (c_copy,) = m.mark_computed("a", 4)  # C on its way
    m.free("a")
    m.allocate("b", [7, 8])
    (b_copy,) = m.mark_computed("b", 2)  # takes the host's last block: P's, the oldest
    parent, child = m.keys_for(a)
    assert parent not in m.host.lookup and parent in m.device.lookup
    m.free("b")
    m.complete(b_copy, True)
    m.complete(c_copy, True)  # host queue: b's block, then C
    assert child in m.host.lookup
    got = m.allocate("c", [5, 6, 9, 9, 11, 12, 13])  # four fresh blocks: every one, P's last
    back = [p for p in got.plans if m.copies.records[p.plan_id].purpose is Purpose.WRITE_BACK]
    assert [p.kind for p in back] == [CopyKind.SWAP_OUT] and not got.ready
    assert m.copies.records[back[0].plan_id].keys == [parent]  # C has a host copy: only P moves
    for p in got.plans:
        m.complete(p, True)
    assert m.is_ready("c")
    hit = m.match(a + [0])
    assert len(hit.host_blocks) == 2, "P and C reachable from the root (P's write-back evicted b's block)"
    m.check_integrity()
