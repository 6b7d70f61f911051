"""Under write-through a running request holds the host copies of its chain (tiering.hold_chain):
they stay out of the host's eviction queue while it runs, its block fills look at their own
blocks only, and it lets them go leaves first with its device table."""
from __future__ import annotations

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.pool import BlockPool, BlockState
from fastkv.cache.write_policy import WritePolicy

BS = 2


def manager(dev: int = 16, host: int = 16) -> CacheManager:
    return CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS,
                                    policy=WritePolicy.WRITE_THROUGH))


def settle(m: CacheManager, plans) -> None:
    for p in plans:
        settle(m, m.complete(p, True).plans)


def host_block(m: CacheManager, key: bytes) -> int:
    return m.host.lookup[key]


def test_a_running_requests_host_copies_are_held_and_queued_leaves_first_when_it_finishes():
    m = manager(host=4)
    toks = list(range(1, 7))  # 3 full blocks
    m.allocate("a", toks)
    settle(m, m.mark_computed("a", len(toks)))
    keys = m.keys_for(toks)
    assert all(m.host.block_state(host_block(m, k)) is BlockState.ALLOCATED for k in keys)
    # a request of fresh blocks wants the whole host tier: a's copies are not evicted for it
    m.allocate("b", list(range(100, 108)))
    settle(m, m.mark_computed("b", 8))
    assert all(k in m.host.lookup for k in keys) and m.stats.skipped_copies == 3
    m.free("b")
    m.free("a")
    order = [m.host.key[b] for b in m.host.evictable]  # next victim first
    a_order = [k for k in order if k in keys]
    assert a_order == keys[::-1], "leaves first: the last block is evicted first"
    m.check_integrity()


def test_a_block_fill_holds_only_the_keys_it_has_not_held_before(monkeypatch):
    """The hold over the chain is extended, not taken again: a fill at any context length looks
    up its new keys only, not its whole chain."""
    m = manager(dev=64, host=64)
    asked: list[int] = []
    real = BlockPool.hold_keys
    monkeypatch.setattr(BlockPool, "hold_keys",
                        lambda pool, keys, skip: asked.append(len(keys)) or real(pool, keys, skip))
    toks = list(range(1, 2 * 20 + 1))  # 20 blocks
    m.allocate("a", toks)
    settle(m, m.mark_computed("a", 2 * 10))
    for n in range(11, 21):  # one block a step
        settle(m, m.mark_computed("a", 2 * n))
    assert asked == [10] + [1] * 10, asked
    assert len(m.host.lookup) == 20 and all(m.host.ref[host_block(m, k)] == 1 for k in m.keys_for(toks))
    m.check_integrity()


def test_a_parent_still_flying_joins_the_hold_of_the_request_that_extends_it():
    m = manager()
    p_toks = [1, 2]
    m.allocate("a", p_toks)
    (p_copy,) = m.mark_computed("a", 2)  # P flies to the host
    m.allocate("b", p_toks + [3, 4])  # P is a device hit
    settle_b = m.mark_computed("b", 4)  # C: b's hold reaches P, still on its way
    parent = m.keys_for(p_toks)[0]
    assert parent not in m.host.lookup
    m.complete(p_copy, True)
    hb = host_block(m, parent)
    assert m.host.ref[hb] == 2, "a and b both hold P's host copy"
    m.free("a")
    assert m.host.block_state(hb) is BlockState.ALLOCATED, "b still holds it"
    settle(m, settle_b)
    m.free("b")
    assert m.host.block_state(hb) is BlockState.CACHED
    m.check_integrity()


def test_a_hold_let_go_of_before_its_parent_lands_takes_nothing_when_it_does():
    m = manager()
    p_toks = [1, 2]
    m.allocate("a", p_toks)
    (p_copy,) = m.mark_computed("a", 2)
    m.allocate("b", p_toks + [3, 4])
    c_plans = m.mark_computed("b", 4)
    m.free("b")  # its C copy takes a hold of its own on P: P is not on the host yet
    m.free("a")
    m.allocate("b2", [9, 10])  # a new hold of another request before P lands
    settle(m, m.mark_computed("b2", 2))
    m.complete(p_copy, True)
    hb = host_block(m, m.keys_for(p_toks)[0])
    held_by_c_copy = 1
    assert m.host.ref[hb] == held_by_c_copy, "only the C copy in flight holds P: b's hold was let go of"
    settle(m, c_plans)
    assert m.host.block_state(hb) is BlockState.CACHED
    m.check_integrity()


def test_an_offload_with_no_host_room_lets_a_running_request_go_of_its_chain_hold():
    """The host is full of a's held copies; offloading b takes room by letting a's hold go (its
    copies queue leaves first and the offload evicts the leaf), not by failing."""
    m = manager(dev=8, host=3)
    a_toks = list(range(1, 7))  # 3 full blocks: the whole host tier
    m.allocate("a", a_toks)
    settle(m, m.mark_computed("a", 6))
    m.allocate("b", [50])
    assert m.mark_computed("b", 1) == []  # no full block: nothing to write through
    assert m.host.num_available == 0
    plans = m.offload("b")
    assert plans is not None and m.stats.chain_spills == 1
    a_keys = m.keys_for(a_toks)
    assert a_keys[2] not in m.host.lookup and a_keys[1] in m.host.lookup, "the leaf went, its parents stayed"
    assert m.host.block_state(host_block(m, a_keys[0])) is BlockState.CACHED
    settle(m, plans)
    assert m.is_offloaded("b")
    # a's next block fill holds its chain anew, from the root
    m.append_slots("a", [7, 8])
    settle(m, m.mark_computed("a", 8))
    assert all(m.host.block_state(host_block(m, k)) is BlockState.ALLOCATED for k in a_keys[:2])
    m.check_integrity()


def test_a_write_through_does_not_take_another_running_requests_held_copies():
    m = manager(dev=8, host=2)
    a_toks = [1, 2, 3, 4]
    m.allocate("a", a_toks)
    settle(m, m.mark_computed("a", 4))
    m.allocate("b", [9, 10])
    assert m.mark_computed("b", 2) == [] and m.stats.skipped_copies == 1 and m.stats.chain_spills == 0
    assert all(k in m.host.lookup for k in m.keys_for(a_toks))
    m.check_integrity()
