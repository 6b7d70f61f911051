"""Leaves first in every tier, by construction: a block is evicted from a tier only once no
keyed child of it is left in that tier (nor one a copy brings there), whatever order parent and
child reached it in. A child left behind its evicted parent is never hit again (matching walks
from the root) yet holds its block until it ages out.

The regressions: a parent and its child reach the host in separate plans, the parent first;
and under write-back a device victim's copy to the host flies while the host evicts its parent
to make room for it (found by the randomized scheduler replay below with copies completed out
of order: the child landed behind a parent no tier had).
"""
from __future__ import annotations

import numpy as np

from fastkv.cache.index import Cause
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.pool import BlockPool
from fastkv.cache.write_policy import WritePolicy
from fastkv.sched import PreemptionMode, Request, Scheduler, SchedulerConfig
from fastkv.sched.output import StepOutput

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


def strands_by_eviction(m: CacheManager, parent_of: dict[bytes, bytes]) -> list[bytes]:
    """CACHED keys whose parent no tier has, nor a copy brings, and that left by eviction
    (``parent_of``: the chains the test saw allocated; nothing of the pools' own bookkeeping)."""
    present = (m.device.lookup, m.host.lookup, m.index.stored, m.copies.inflight, m.copies.loading)
    out = []
    for pool in (m.device, m.host):
        for b, k in enumerate(pool.key):
            p = parent_of.get(k)
            if k is None or p is None or pool.block_state(b).name != "CACHED" or any(p in w for w in present):
                continue
            record = m.index.history.get(p)
            if record is not None and record[1] is Cause.EVICTED:
                out.append(k)
    return out


def test_a_write_back_in_flight_keeps_its_parent_on_the_host():
    rng = np.random.default_rng(3)
    cache = CacheManager(CacheConfig(num_device_blocks=48, num_host_blocks=64, block_size=16))
    sched = Scheduler(cache, SchedulerConfig(preemption=PreemptionMode.RECOMPUTE, max_num_batched_tokens=128,
                                             block_bytes=4096, long_prefill_token_threshold=0))
    parent_of: dict[bytes, bytes] = {}
    for i in range(120):
        prompt = rng.integers(0, 50, int(rng.integers(8, 150)))
        keys = cache.keys_for(prompt)
        parent_of.update(zip(keys[1:], keys, strict=False))
        sched.add_request(Request(i, prompt, max_new_tokens=int(rng.integers(4, 40))))
    pending = []

    def check():
        assert strands_by_eviction(cache, parent_of) == [], "a cached child behind a parent evicted before it"

    while sched.has_work():
        out = sched.step()
        pending += out.copies
        while len(pending) > 3:  # up to four copies in flight, completed in a random order
            sched.on_copy_complete(pending.pop(int(rng.integers(len(pending)))).plan_id, True)
            check()
        if not out.plan.seqs and pending:
            sched.on_copy_complete(pending.pop(0).plan_id, True)
        if out.plan.seqs:
            sched.on_step_output(StepOutput(out.plan.step_id, {q.request_id: 7 for q in out.plan.seqs if q.sample},
                                            0.001))
        check()
    sched.check_integrity()


def test_a_child_whose_parent_is_lost_is_dropped_not_kept_stranded():
    """Write-through, 7 device and 3 host blocks, no storage; parent P and child C reach the host
    in separate plans, and P's copy fails. A loss may strand a child, but then the child goes
    too: once the request is freed without caching, P is in no tier, and C, CACHED on the host,
    is dropped at once instead of holding a block nothing can match (fastkv.cache.strands)."""
    m = CacheManager(CacheConfig(num_device_blocks=7, num_host_blocks=3, block_size=BS,
                                 policy=WritePolicy.WRITE_THROUGH))
    a = [1, 2, 3, 4, 5]
    m.test_chains = [a]
    parent, child = m.keys_for(a)
    m.allocate("a", a)
    (p_copy,) = m.mark_computed("a", 2)
    (c_copy,) = m.mark_computed("a", 4)  # a later plan than its parent's
    m.complete(p_copy, False)  # P never reaches the host
    m.complete(c_copy, True)
    m.check_integrity()
    assert child in m.host.lookup and parent not in m.host.lookup and parent in m.device.lookup
    m.free("a", cache=False)  # P leaves its last tier
    m.check_integrity()
    assert parent not in m.device.lookup and child not in m.host.lookup
    assert stranded(m) == []
    assert m.explain_miss(np.array(a, np.int32)).cause is Cause.DROPPED
    assert m.index.history[child][1] is Cause.STRANDED


class CountedReads(list):
    """A pool's per-block list that counts the reads of its items from Python."""

    reads = 0

    def __getitem__(self, i):
        CountedReads.reads += 1
        return super().__getitem__(i)


def test_a_loss_reads_only_the_children_of_the_key_it_lost():
    """A request that hit a cached parent P is freed without caching: P leaves every tier, and its
    cached child C (another request's) goes with it. Finding C reads the pools at P's children,
    not at every block: on a tier of 4,096 blocks the drop reads a handful."""
    m = CacheManager(CacheConfig(num_device_blocks=4096, block_size=BS))
    m.allocate("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    m.free("a")  # P = [1, 2] and C = [3, 4] cached
    parent, child = m.keys_for([1, 2, 3, 4])
    m.allocate("b", [1, 2, 9])  # hits P
    dev = m.device
    dev.parent, dev.state, dev.ref = CountedReads(dev.parent), CountedReads(dev.state), CountedReads(dev.ref)
    CountedReads.reads = 0
    m.free("b", cache=False)
    assert parent not in dev.lookup and child not in dev.lookup
    assert CountedReads.reads < 16, f"{CountedReads.reads} reads of the pool's lists for one lost key"
    m.check_integrity()
