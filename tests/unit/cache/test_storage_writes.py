"""Which blocks reach the storage tier under each storage write policy, and the storage resume
of a partial last block (fastkv.cache.storage_writes)."""
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import StorageWrites, WritePolicy
from tests.unit.cache.test_manager import BS, drain, mk, run_prompt, toks


def pool(writes, dev=4, host=4, **kw):
    return mk(dev=dev, host=host, storage=True, policy=WritePolicy.WRITE_THROUGH, storage_writes=writes, **kw)


def stored_labels(m, *labels):
    """Which of the one-block prompts ``toks(label)`` the storage tier holds."""
    return [lab for lab in labels if m.keys_for(toks(lab))[0] in m.index.stored]


def test_through_stores_every_block_once_it_lands_on_the_host():
    m = pool(StorageWrites.THROUGH)
    run_prompt(m, "a", toks(1, 2, extra=1))
    assert len(m.index.stored) == 2 and m.stats.store_blocks == 2


def test_through_stores_blocks_whose_write_through_found_the_host_pinned_by_slow_stores():
    """Regression (restart tests on a loaded machine): STOREs to a slow store pinned every host
    block, so the next blocks' write-throughs were skipped; those never reached the host, nor
    storage, and a restart on the same store missed them. Now they are made once blocks free up."""
    m = pool(StorageWrites.THROUGH, dev=6, host=2)
    assert not m.allocate("a", toks(1, 2)).plans
    (through,) = m.mark_computed("a", 2 * BS)
    (store,) = m.complete(through, True).plans  # lands, and its STORE pins both host blocks
    assert store.kind is CopyKind.STORE and m.host.num_available == 0
    assert not m.allocate("b", toks(3, 4)).plans
    assert m.mark_computed("b", 2 * BS) == [] and m.stats.skipped_copies == 2
    m.free("a")  # while it ran it held its host copies (tiering.hold_chain)
    (late,) = m.complete(store, True).plans  # the store landed: the host has room again
    assert late.kind is CopyKind.SWAP_OUT and list(late.src) == list(m.block_table("b"))
    drain(m, [late])
    keys = m.keys_for(toks(1, 2)) + m.keys_for(toks(3, 4))
    assert all(k in m.index.stored for k in keys) and m.stats.late_copies == 2


def test_a_skipped_write_through_is_not_made_once_its_block_left_the_device():
    m = pool(StorageWrites.THROUGH, dev=2, host=2)
    assert not m.allocate("a", toks(1, 2)).plans
    (through,) = m.mark_computed("a", 2 * BS)
    (store,) = m.complete(through, True).plans
    m.free("a")
    m.allocate("b", toks(3))
    assert m.mark_computed("b", BS) == [] and m.stats.skipped_copies == 1
    m.free("b")
    m.allocate("c", toks(5, 6))  # evicts b's block (and a's): the write-back finds no host room either
    assert m.keys_for(toks(3))[0] not in m.device.lookup
    assert m.complete(store, True).plans == () and m.stats.late_copies == 0
    m.check_integrity()


def test_preempted_stores_only_the_blocks_of_preempted_requests_also_those_already_on_the_host():
    m = pool(StorageWrites.PREEMPTED, dev=6, host=6)
    run_prompt(m, "a", toks(1, 2, extra=1))  # finished, never preempted: not stored
    assert not m.index.stored and m.stats.store_blocks == 0
    a = m.allocate("b", toks(3, 4, extra=2))
    drain(m, a.plans)
    drain(m, m.mark_computed("b", 2 * BS + 2))  # its full blocks go to the host (write-through) only
    assert not m.index.stored
    drain(m, m.offload("b"))  # copies just the partial block; stores both full blocks
    assert [k in m.index.stored for k in m.keys_for(toks(3, 4))] == [True, True]
    assert len(m.index.stored) == 2  # the partial block of an offload mode preemption stays private


def test_back_stores_host_blocks_only_as_evictions_approach_them():
    m = pool(StorageWrites.BACK, dev=2, host=3, flush_window=2)
    for lab in (1, 2, 3):  # the host fills: no eviction, nothing stored
        run_prompt(m, f"r{lab}", toks(lab, extra=1))
    assert not m.index.stored and m.stats.host_evictions == 0
    run_prompt(m, "r4", toks(4, extra=1))  # evicts block 1 (lost to storage) and flushes block 2, next in line
    assert m.stats.host_evictions == 1 and m.stats.unstored_host_evictions == 1
    assert stored_labels(m, 1, 2, 3, 4) == [2]
    run_prompt(m, "r5", toks(5, extra=1))  # evicts 3 (2 went to the back of the queue when flushed); flushes 4
    assert stored_labels(m, 1, 2, 3, 4, 5) == [2, 4]
    assert m.match(toks(2, extra=1)).host_blocks  # flushed blocks stay cached on the host


def preempted_to_storage(rid: str = "r"):
    """A pool whose request ``rid`` (two full blocks and a partial one, one sampled token
    pending) was preempted in storage mode and freed; returns (pool, prompt, the offload's completions)."""
    m = pool(StorageWrites.PREEMPTED, dev=4, host=3)
    prompt = toks(1, 2, extra=2)
    drain(m, m.allocate(rid, prompt).plans)
    drain(m, m.mark_computed(rid, len(prompt)))
    m.append_slots(rid, [77])  # its first sampled token, not computed yet
    done = drain(m, m.offload(rid, to_storage=True))
    m.free(rid)  # storage mode: the host copies are let go
    return m, prompt, done


def test_a_storage_mode_resume_loads_the_partial_block_from_storage_and_recomputes_nothing():
    m, prompt, done = preempted_to_storage()
    stores = [p for c in done for p in c.plans if p.kind is CopyKind.STORE]
    assert sum(len(p.keys) for p in stores) == 3  # two full blocks and the partial one
    for lab in (5, 6, 7):
        run_prompt(m, f"x{lab}", toks(lab, extra=1))  # push r's blocks out of the host
    resumed = list(prompt) + [77]
    assert not m.match(resumed).host_blocks
    b = m.allocate("r", resumed)
    loads = [p for p in b.plans if p.kind is CopyKind.LOAD]
    assert len(loads) == 1 and len(loads[0].keys) == 3
    assert b.num_pending_tokens == len(prompt)  # every computed token comes back, the partial block's too
    (ready,) = [r for c in drain(m, b.plans) for r in c.ready]
    assert ready.num_computed_tokens == len(prompt)  # one token left to compute: the sampled one
    assert m.stats.storage_hit_tokens == len(prompt) and m.stats.storage_lost_tokens == 0


def test_another_request_with_the_same_tokens_never_matches_a_resume_key():
    m, prompt, _ = preempted_to_storage()
    other = m.allocate("s", list(prompt) + [77])
    assert other.num_cached_tokens + other.num_pending_tokens == 2 * BS  # full blocks only


def preempt_to_storage(m, rid, prompt):
    """Runs ``prompt``, samples one token, preempts in storage mode; returns the STOREd keys."""
    a = m.allocate(rid, prompt)
    drain(m, a.plans)
    drain(m, m.mark_computed(rid, len(prompt)))
    m.append_slots(rid, [77])
    stores = [p for c in drain(m, m.offload(rid, to_storage=True)) for p in c.plans if p.kind is CopyKind.STORE]
    m.free(rid)
    return [k for p in stores for k in p.keys]


def test_a_resume_key_is_scoped_to_this_run():
    """Engines number requests from 0, so a restart or a second engine on the same store preempts
    a request with the same id and tokens: its resume key must not be the other run's."""
    prompt = toks(1, 2, extra=2)
    a, b = (set(preempt_to_storage(pool(StorageWrites.PREEMPTED), 0, prompt)) for _ in range(2))
    assert len(a & b) == 2 and len(a - b) == 1  # the full blocks are shared; the partial block is not


def test_a_resume_key_matches_once_only_for_the_request_it_was_stored_for():
    m = pool(StorageWrites.PREEMPTED, dev=4, host=3)
    prompt = toks(1, 2, extra=2)
    preempt_to_storage(m, "r", prompt)
    resumed = list(prompt) + [77]
    b = m.allocate("r", resumed)
    assert b.num_cached_tokens + b.num_pending_tokens == len(prompt)  # its partial block is back
    drain(m, b.plans)
    m.free("r")
    again = m.allocate("r", resumed)  # same id and tokens, but no preempted state left to resume
    assert again.num_cached_tokens + again.num_pending_tokens == 2 * BS


def test_through_defers_stores_past_the_backlog_and_makes_them_once_it_drains():
    """Storage slower than the engine makes blocks: past ``storage_backlog_blocks`` STORE blocks
    in flight the write-through STOREs are deferred, never queued without bound, and made once
    the STOREs in flight land, while the host still holds their blocks."""
    m = pool(StorageWrites.THROUGH, dev=8, host=8, storage_backlog_blocks=2)
    assert not m.allocate("a", toks(1, 2, 3)).plans
    (through,) = m.mark_computed("a", 3 * BS)
    (store,) = m.complete(through, True).plans
    assert store.kind is CopyKind.STORE and len(store.src) == 2 and len(m.state.deferred_stores) == 1
    assert not m.allocate("b", toks(4)).plans
    (through_b,) = m.mark_computed("b", BS)
    assert m.complete(through_b, True).plans == () and len(m.state.deferred_stores) == 2  # the backlog is full
    assert m.skipped_stores() == {"already_stored": 0, "tail": 0, "shared": 2}  # lost if the run ended now
    (late,) = m.complete(store, True).plans  # it drained: the deferred ones, the host still holds them
    assert set(late.keys) == {m.keys_for(toks(1, 2, 3))[2], m.keys_for(toks(4))[0]}
    drain(m, [late])
    assert m.stats.store_blocks == 4 and m.stats.late_stores == 2 and m.stats.skipped_stores == 0
    assert m.skipped_stores() == {"already_stored": 0, "tail": 0, "shared": 0}
    m.check_integrity()


def test_a_deferred_store_whose_block_left_the_host_is_lost_and_counted():
    m = pool(StorageWrites.THROUGH, dev=4, host=3, storage_backlog_blocks=1)
    drain(m, m.allocate("a", toks(1, 2)).plans)
    (through,) = m.mark_computed("a", 2 * BS)
    (store,) = m.complete(through, True).plans  # one block stored, one deferred
    assert len(store.src) == 1 and len(m.state.deferred_stores) == 1
    m.free("a")
    run_prompt(m, "b", toks(5, 6, 7))  # the host evicts a's unstored block for b's
    deferred = m.keys_for(toks(1, 2))[1]
    assert deferred not in m.host.lookup
    (late,) = [p for p in m.complete(store, True).plans if p.kind is CopyKind.STORE]  # b's, still on the host
    assert deferred not in late.keys and m.stats.late_stores == len(late.keys)
    assert m.stats.skipped_stores == 1 and m.stats.skipped_shared_stores == 1
    m.check_integrity()


def test_a_request_preempted_to_storage_is_stored_whatever_the_backlog():
    m = pool(StorageWrites.THROUGH, dev=6, host=6, storage_backlog_blocks=0)
    drain(m, m.allocate("b", toks(3, 4, extra=2)).plans)
    drain(m, m.mark_computed("b", 2 * BS + 2))
    assert m.stats.skipped_stores == 2 and not m.index.stored  # write-through STOREs: none in flight, lost
    drain(m, m.offload("b", to_storage=True))  # the victim resumes from storage: stored, backlog or not
    assert all(k in m.index.stored for k in m.keys_for(toks(3, 4)))
    assert m.stats.skipped_stores == 2 and m.stats.store_blocks == 3  # its partial block too
    m.check_integrity()
