"""Admissions whose prefix another request is already LOADing from storage join that LOAD
instead of loading their own copy (fastkv.cache.copies, coalesced storage loads)."""
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy
from tests.unit.cache.test_manager import BS, drain, mk, toks


def restarted(dev=12, host=8):
    """A cache that knows from a lookup that storage holds blocks 1..4 (a restart's view)."""
    m = mk(dev=dev, host=host, storage=True, policy=WritePolicy.WRITE_THROUGH)
    m.confirm_stored(m.keys_for(toks(1, 2, 3, 4)))
    return m


def loads(plans):
    return [p for p in plans if p.kind is CopyKind.LOAD]


def test_two_requests_with_one_prefix_in_one_wave_load_each_key_once():
    m = restarted()
    a = m.allocate("a", toks(1, 2, 3, extra=1))
    b = m.allocate("b", toks(1, 2, 3, extra=2))
    (load,) = loads(a.plans)
    assert list(load.keys) == m.keys_for(toks(1, 2, 3))
    assert not b.plans and not b.ready and b.num_pending_tokens == 3 * BS  # waits for a's LOAD
    done = drain(m, [load])
    assert sorted(r.request_id for c in done for r in c.ready) == ["a", "b"]
    assert m.num_computed_tokens("a") == m.num_computed_tokens("b") == 3 * BS
    st = m.stats
    assert (st.load_blocks, st.joined_load_blocks) == (3, 3)
    # served once from storage (a), and to b from the host, where that load landed
    assert (st.storage_hit_tokens, st.host_hit_tokens) == (3 * BS, 3 * BS)
    m.free("a")
    m.free("b")
    m.check_integrity()


def test_a_longer_prompt_joins_the_shared_part_and_loads_only_the_rest():
    m = restarted()
    a = m.allocate("a", toks(1, 2, extra=1))
    b = m.allocate("b", toks(1, 2, 3, 4, extra=1))
    (la,) = loads(a.plans)
    (lb,) = loads(b.plans)
    assert list(lb.keys) == m.keys_for(toks(1, 2, 3, 4))[2:]
    drain(m, [lb])  # b's own LOAD lands first: b still waits for a's
    assert m.num_computed_tokens("b") == 0
    drain(m, [la])
    assert m.num_computed_tokens("b") == 4 * BS and m.num_computed_tokens("a") == 2 * BS
    assert (m.stats.storage_hit_tokens, m.stats.host_hit_tokens) == (4 * BS, 2 * BS)
    m.check_integrity()


def test_a_failed_shared_load_is_recomputed_by_every_request_that_waited_for_it():
    m = restarted()
    a = m.allocate("a", toks(1, 2, extra=1))
    m.allocate("b", toks(1, 2, extra=3))
    done = drain(m, loads(a.plans), ok=False)
    assert sorted((r.request_id, r.num_computed_tokens) for c in done for r in c.ready) == [("a", 0), ("b", 0)]
    st = m.stats
    assert (st.storage_hit_tokens, st.host_hit_tokens, st.storage_lost_tokens) == (0, 0, 2 * BS)
    m.check_integrity()


def test_a_waiter_freed_before_the_load_lands_leaves_the_others_intact():
    m = restarted()
    a = m.allocate("a", toks(1, 2, extra=1))
    m.allocate("b", toks(1, 2, extra=2))
    m.free("a")  # the owner goes away; its LOAD still lands for b
    m.check_integrity()
    drain(m, loads(a.plans))
    assert m.num_computed_tokens("b") == 2 * BS and m.is_ready("b")
    m.free("b")
    m.check_integrity()


def test_a_load_that_lands_for_nobody_counts_no_storage_hit_and_serves_the_next_admission_from_the_host():
    """CI (storage-lmdb, tp 2): a victim re-admitted with a LOAD in flight was preempted by
    recompute again before it landed; one LOAD ran, and storage served no token."""
    m = restarted()
    a = m.allocate("a", toks(1, 2, extra=1))
    m.free("a")  # preempted by recompute while loading
    drain(m, loads(a.plans))
    st = m.stats
    assert (st.load_blocks, st.storage_hit_tokens, st.host_hit_tokens) == (2, 0, 0)
    again = m.allocate("a", toks(1, 2, extra=1))
    assert not loads(again.plans) and again.num_pending_tokens == 2 * BS
    drain(m, again.plans)
    assert (st.storage_hit_tokens, st.host_hit_tokens) == (0, 2 * BS)
    assert m.num_computed_tokens("a") == 2 * BS
    m.check_integrity()
