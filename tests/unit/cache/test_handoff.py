"""Prefill -> decode handoff through storage, the cache's side: what the prefill engine exports
is exactly what the decode engine's allocation loads, its partial block included."""
import numpy as np
import pytest

from fastkv.cache import handoff
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy

BS = 4
PROMPT = np.arange(100, 100 + 2 * BS + 3, dtype=np.int32)  # two full blocks, a partial one of 3
KNOWN = len(PROMPT) - 1  # what the decode side needs: all but the last token


def mk(dev=8, host=4):
    return CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS,
                                    policy=WritePolicy.WRITE_BACK, storage=True))


def drain(mgr, plans, ok=True, kinds=None):
    plans, ready = list(plans), []
    while plans:
        p = plans.pop(0)
        if kinds is not None:
            kinds.append(p.kind)
        c = mgr.complete(p, ok)
        ready += c.ready
        plans += c.plans
        mgr.check_integrity()
    return ready


def tail_of(mgr, rid="r1"):
    return handoff.tail_key(mgr.state, mgr.keys_for(PROMPT), mgr.state.root, rid, PROMPT.tolist())


def prefill(mgr, rid="r1", ok=True):
    a = mgr.allocate(rid, PROMPT)
    drain(mgr, a.plans)
    drain(mgr, mgr.mark_computed(rid, len(PROMPT)))
    keys, plans = handoff.export(mgr.state, rid, KNOWN, tail_of(mgr, rid))
    mgr.free(rid)  # the copies pin what they read
    kinds = []
    drain(mgr, plans, ok, kinds)
    return keys, kinds


def test_the_decode_side_loads_every_token_before_the_last_and_recomputes_none():
    p, d = mk(), mk()
    keys, kinds = prefill(p)
    assert kinds == [CopyKind.SWAP_OUT, CopyKind.STORE] and len(keys) == 3
    assert handoff.exported(p.state, keys) is True
    assert keys[:2] == d.keys_for(PROMPT) and keys[2] == tail_of(d)  # both sides name the same keys
    d.confirm_stored(keys[:2])
    a = d.allocate("x", PROMPT, tail_key=keys[2])
    assert (a.num_cached_tokens, a.num_pending_tokens) == (0, KNOWN)
    (load,) = [pl for pl in a.plans if pl.kind is CopyKind.LOAD]
    assert list(load.keys) == keys
    (ready,) = drain(d, a.plans)
    assert ready.num_computed_tokens == KNOWN
    assert d.stats.storage_hit_tokens == KNOWN and d.stats.storage_lost_tokens == 0


def test_a_lost_tail_costs_only_its_tokens():
    d = mk()
    keys = d.keys_for(PROMPT)
    d.confirm_stored(keys)
    a = d.allocate("x", PROMPT, tail_key=tail_of(d))
    load = next(pl for pl in a.plans if pl.kind is CopyKind.LOAD)
    c = d.complete(load, False)  # the value was never written (or vanished)
    assert c.plans == () and d.stats.storage_lost_tokens == KNOWN


def test_a_tail_behind_a_missing_block_is_not_loaded():
    d = mk()
    d.confirm_stored(d.keys_for(PROMPT)[:1])
    a = d.allocate("x", PROMPT, tail_key=tail_of(d))
    assert a.num_pending_tokens == BS  # the second block is not stored: the tail is no use


def test_export_names_what_is_lost_when_a_copy_fails():
    p = mk()
    keys, _ = prefill(p, ok=False)
    assert handoff.exported(p.state, keys) is False


def test_export_refuses_tokens_not_computed():
    p = mk()
    drain(p, p.allocate("r1", PROMPT).plans)
    with pytest.raises(ValueError, match="2 computed|0 computed"):
        handoff.export(p.state, "r1", KNOWN, tail_of(p))


def test_blocks_that_found_no_host_room_are_copied_again_from_the_prefix_cache():
    p, d = mk(host=1), mk()  # one host block: the export copies one block at a time
    keys, kinds = prefill(p)
    assert kinds == [CopyKind.SWAP_OUT, CopyKind.STORE]
    assert p.state.index.stored.keys() & set(keys) == {keys[2]}  # the partial block went first
    for _ in range(len(keys)):
        if handoff.exported(p.state, keys):
            break
        assert handoff.exported(p.state, keys) is False
        drain(p, handoff.retry(p.state, keys))
    assert handoff.exported(p.state, keys) is True
    d.confirm_stored(keys[:2])
    (ready,) = drain(d, d.allocate("x", PROMPT, tail_key=keys[2]).plans)
    assert ready.num_computed_tokens == KNOWN and d.stats.storage_lost_tokens == 0


def export_behind_a_busy_host_tier(p):
    """r0's export holds the only host block (its copy not done) when r1 finishes and exports:
    nothing of r1 finds a host block. Returns r0's keys, r0's plans and r1's keys."""
    other = PROMPT + 1000
    drain(p, p.allocate("r0", other).plans)
    drain(p, p.mark_computed("r0", len(other)))
    k0, busy = handoff.export(p.state, "r0", KNOWN, handoff.tail_key(p.state, p.keys_for(other), p.state.root, "r0",
                                                                      other.tolist()))
    p.free("r0")
    assert busy and p.host.num_available == 0
    drain(p, p.allocate("r1", PROMPT).plans)
    drain(p, p.mark_computed("r1", len(PROMPT)))
    keys, plans = handoff.export(p.state, "r1", KNOWN, tail_of(p))
    assert plans == []
    return k0, busy, keys


def test_the_partial_block_is_held_for_its_export_when_the_host_tier_is_all_in_flight_at_finish():
    """The only host block is pinned by another export's copy when r1 finishes: nothing of r1
    finds a host block, and its partial block (unkeyed, so not in the prefix cache) must still
    be there for the retry once that copy is done."""
    p, d = mk(host=1), mk()
    _, busy, keys = export_behind_a_busy_host_tier(p)
    p.free("r1")
    p.check_integrity()
    drain(p, busy)
    for _ in range(2 * len(keys)):
        if handoff.exported(p.state, keys):
            break
        assert handoff.exported(p.state, keys) is False
        drain(p, handoff.retry(p.state, keys))
    assert handoff.exported(p.state, keys) is True
    free = p.device.num_available
    handoff.release(p.state, keys)
    p.check_integrity()
    assert p.device.num_available == free + len(keys)  # r1's blocks come back: full ones cached, the partial one free
    assert set(p.state.handoff_holds).isdisjoint(keys)
    d.confirm_stored(keys[:2])
    (ready,) = drain(d, d.allocate("x", PROMPT, tail_key=keys[2]).plans)
    assert ready.num_computed_tokens == KNOWN and d.stats.storage_lost_tokens == 0


def test_full_blocks_of_an_export_outlive_device_pressure_until_stored():
    """Regression (a PD run on a loaded machine recorded ``failed: 1``): r1's export finds no host
    block; once r1 is freed its full blocks were only CACHED, so r2's allocation evicted them
    before the retry, and the export was lost. The export holds them until it is stored."""
    p = mk(dev=8, host=1)
    k0, busy, keys = export_behind_a_busy_host_tier(p)
    p.free("r1")
    big = np.arange(5000, 5000 + BS * p.device.num_available, dtype=np.int32)
    drain(p, p.allocate("r2", big).plans)  # takes every block it can, evicting what is only cached
    p.check_integrity()
    drain(p, busy)
    for _ in range(2 * len(keys)):
        if handoff.exported(p.state, keys):
            break
        drain(p, handoff.retry(p.state, keys))
    assert handoff.exported(p.state, keys) is True
    handoff.release(p.state, keys)
    handoff.release(p.state, k0)
    p.check_integrity()
    assert not p.state.handoff_holds


def test_exports_sharing_a_prefix_share_its_holds():
    p = mk(dev=12, host=4)
    drain(p, p.allocate("r1", PROMPT).plans)
    drain(p, p.mark_computed("r1", len(PROMPT)))
    drain(p, p.allocate("r2", PROMPT).plans)  # the same full blocks (prefix hits), its own partial one
    drain(p, p.mark_computed("r2", len(PROMPT)))
    k1, pl1 = handoff.export(p.state, "r1", KNOWN, tail_of(p, "r1"))
    k2, pl2 = handoff.export(p.state, "r2", KNOWN, tail_of(p, "r2"))
    assert k1[:2] == k2[:2] and k1[2] != k2[2]
    assert [p.state.handoff_holds[k][1] for k in k1[:2]] == [2, 2]
    p.free("r1")
    p.free("r2")
    drain(p, pl1 + pl2)
    handoff.release(p.state, k1)
    p.check_integrity()
    assert set(p.state.handoff_holds) == set(k2)
    handoff.release(p.state, k2)
    p.check_integrity()
    assert not p.state.handoff_holds and p.device.num_available == 12


def test_a_weight_update_is_refused_while_an_export_holds_device_blocks():
    p = mk(dev=8, host=1)
    k0, busy, keys = export_behind_a_busy_host_tier(p)
    p.free("r1")
    drain(p, busy)
    with pytest.raises(ValueError, match="device blocks held by prefill exports"):
        p.begin_weight_update()
    handoff.release(p.state, keys)
    handoff.release(p.state, k0)
    p.begin_weight_update()


def test_an_export_that_evicts_a_parent_drops_the_children_it_strands_before_it_returns():
    """The host block an export takes evicts the only cached host block, a parent whose child
    is pinned by its STORE there (so it is evicted by force): the child, whose parent is now in
    no tier, loses its key within the export, not at some later call."""
    m = CacheManager(CacheConfig(num_device_blocks=4, num_host_blocks=3, block_size=2,
                                 policy=WritePolicy.WRITE_BACK, storage=True))
    chain = [1, 2, 3, 4, 7, 8, 19]
    k12, k34, k78 = m.keys_for(chain)
    plans = list(m.allocate("a", chain).plans) + m.mark_computed("a", len(chain))
    m.free("a")  # K12, K34, K78 cached on the device
    plans += m.allocate("b", [1, 37]).plans  # one fresh block: the device is full
    plans += m.mark_computed("b", 2)
    plans += m.allocate("c", [1, 2, 3, 17]).plans  # evicts K78: written back to the host
    m.free("c")
    plans += m.allocate("d", [1, 2, 31]).plans  # evicts K34: written back too
    assert [p.kind for p in plans] == [CopyKind.SWAP_OUT, CopyKind.SWAP_OUT]
    plans += m.complete(plans.pop(1), True).plans  # K34 on the host, its STORE goes out
    plans += m.mark_computed("d", 3)
    _, out = m.export("b", 1, m.tail_key([1, 37], "b"))  # its partial block takes the last free host block
    m.free("b")
    (store,) = [p for p in plans if p.kind is CopyKind.STORE]
    plans.remove(store)
    m.complete(store, False)  # K34 is not stored: on the host only
    m.complete(plans.pop(0), True)  # K78 lands on the host, its STORE pins it there
    assert m.host.lookup.keys() == {k34, k78}
    m.export("d", 2, None)  # K12 to the host: evicts K34, the only cached host block
    assert k34 not in m.host.lookup and k34 not in m.device.lookup and k34 not in m.index.stored
    assert k78 not in m.host.lookup  # stranded behind K34: dropped by the export itself
    m.check_integrity()
