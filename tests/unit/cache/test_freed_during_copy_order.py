"""Regression: a request freed while its offload flies must leave its blocks leaves first.

The manager state machine reported "a cached key is stranded behind an evicted parent"
(WRITE_BACK, a small host tier). A request freed while a copy of its blocks was in flight
lets go of those blocks only when the copy completes; the completion unpinned them in table
order, parents first, so the LRU queue held a parent ahead of its child and the next eviction
took the parent: the child stayed cached, unreachable behind it (matching walks from the root),
and the parent, which any request with that prefix would hit, was gone. Under WRITE_BACK the
device drops a victim the host also holds, so the device dropped the parent first, then the
host evicted it: the child stayed on both tiers behind a parent on none.
"""
from __future__ import annotations

import numpy as np

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.write_policy import WritePolicy

BS = 2


def _computed(m: CacheManager, rid: int, toks: list[int], n: int) -> None:
    a = m.allocate(rid, np.array(toks, np.int32))
    assert a is not None and a.ready and not a.plans
    assert not m.mark_computed(rid, n)


def test_a_request_freed_during_its_offload_leaves_its_blocks_leaves_first():
    m = CacheManager(CacheConfig(num_device_blocks=8, num_host_blocks=3, block_size=BS, policy=WritePolicy.WRITE_BACK))
    prompt = [1, 2, 3, 4, 5]  # two full blocks (parent, child) and a partial one
    parent, child = m.keys_for(prompt)
    _computed(m, 0, prompt, len(prompt))
    (offload,) = m.offload(0)
    m.free(0)  # preempted, then aborted while the offload flies
    assert not m.complete(offload, True).plans
    # both tiers cache parent and child; a long prompt evicts one device block (the host has it)
    _computed(m, 1, list(range(50, 64)), 4)
    assert (parent in m.device.lookup, child in m.device.lookup) == (True, False), "device evicted the parent first"
    (other,) = m.offload(1)  # two host blocks: the free one and one eviction
    m.complete(other, True)
    assert (parent in m.host.lookup, child in m.host.lookup) == (True, False), "host evicted the parent first"
    present = m.device.lookup.keys() | m.host.lookup.keys()
    assert parent in present or child not in present, "the child is cached behind an evicted parent"
    assert m.match(np.array(prompt, np.int32)).num_blocks == 1
    m.check_integrity()
