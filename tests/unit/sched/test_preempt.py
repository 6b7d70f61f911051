"""Preemption scenarios, one per mode, with the fake worker checking every slot it reads.

Requests of 8 and 10 prompt tokens fill a 5-block device (2 + 3 blocks); when request 0's
third block is needed (its first sampled token), request 1, the most recently admitted, is
the victim, with 10 computed tokens: two full blocks and a partial one.
"""
import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.sched import PreemptionMode, QueuePolicy, RequestState, Scheduler, SchedulerConfig
from tests.sched_harness import Rig

BS = 4
S = RequestState
M = PreemptionMode


def rig(host=8, storage=False, cache_policy=CachePolicy.WRITE_BACK, dev=5, **kw) -> Rig:
    cache = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS,
                                     policy=cache_policy, storage=storage))
    kw.setdefault("max_num_batched_tokens", 32)
    return Rig(Scheduler(cache, SchedulerConfig(block_bytes=1 << 20, **kw)))


def two_requests(r: Rig, **kw) -> None:
    r.add(0, range(1, 9), max_new_tokens=8, **kw)
    r.add(1, range(20, 30), max_new_tokens=8, **kw)


def step_until_preempted(r: Rig, rid: int = 1, copies: bool = True):
    for _ in range(20):
        out = r.step()
        if r.sched.get_request(rid).num_preemptions:
            return out
        if copies:
            r.complete_all()
    raise AssertionError("no preemption")


def test_recompute_preempts_the_latest_admitted_and_reuses_its_cached_prefix():
    r = rig(host=0, preemption=M.RECOMPUTE)
    two_requests(r)
    out = step_until_preempted(r)
    q1 = r.sched.get_request(1)
    assert q1.state is S.WAITING and q1.num_computed_tokens == 0 and q1.mode_used is M.RECOMPUTE
    assert [s.request_id for s in out.plan.seqs] == [0]
    assert r.sched.stats.preempt_recompute == 1
    r.run()
    assert r.finished[1].num_recomputed_tokens > 0
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]
    # a resumed request re-feeds prompt + outputs as one prompt and keeps sampling where it was
    assert len(r.finished[1].output_token_ids) == 8


@pytest.mark.parametrize("cache_policy", list(CachePolicy))
def test_offload_resumes_with_exactly_its_computed_tokens(cache_policy):
    r = rig(cache_policy=cache_policy, preemption=M.OFFLOAD)
    two_requests(r)
    out = step_until_preempted(r)
    q1 = r.sched.get_request(1)
    computed = q1.num_computed_tokens
    assert computed % BS and q1.state is S.OFFLOADING  # a partial last block is part of the copy
    offload = [p for p in out.copies if p.kind is CopyKind.SWAP_OUT and len(p.src) == -(-computed // BS)]
    assert len(offload) == 1 or cache_policy is CachePolicy.WRITE_THROUGH  # full blocks may already be on the host
    assert [s.request_id for s in out.plan.seqs] == []  # 0 stalls: its block is still being copied out
    assert r.sched.stats.stalls == 1
    r.complete_all()
    assert q1.state is S.OFFLOADED and r.sched.cache.request_ids() == [0, 1]
    assert [s.request_id for s in r.step().plan.seqs] == [0]  # 0 grows into the released blocks
    while True:
        r.complete_all()
        mine = [s for s in r.step().plan.seqs if s.request_id == 1]  # the worker checked what 1 reads
        if mine:
            break
    assert mine[0].start_pos == computed and q1.num_restores == 1
    r.run()
    assert r.finished[1].num_recomputed_tokens == 0 and r.sched.stats.recomputed_tokens == 0
    assert r.sched.stats.preempt_offload >= 1 and r.sched.stats.restored >= 1
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]


def test_storage_mode_stores_every_block_and_resumes_without_recomputing():
    r = rig(storage=True, preemption=M.STORAGE)
    two_requests(r)
    out = step_until_preempted(r)
    q1 = r.sched.get_request(1)
    computed = q1.num_computed_tokens
    assert computed % BS and q1.state is S.OFFLOADING and any(p.kind is CopyKind.SWAP_OUT for p in out.copies)
    r.complete_all()
    assert q1.state is S.WAITING and 1 not in r.sched.cache.request_ids()  # host copies let go
    out = r.step()
    stores = [p for p in out.copies if p.kind is CopyKind.STORE]
    # the full blocks and the partial last one (under its resume key) go to storage
    assert sum(len(p.keys) for p in stores) == computed // BS + 1
    r.complete_all()
    r.run()
    assert r.sched.stats.preempt_storage == 1
    assert r.finished[1].num_recomputed_tokens == 0 and r.sched.stats.recomputed_tokens == 0
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]


def test_storage_io_does_not_feed_the_host_copy_estimate():
    r = rig(storage=True, preemption=M.STORAGE)
    two_requests(r)
    step_until_preempted(r)
    r.complete_all()
    stores = [p for p in r.step().copies if p.kind is CopyKind.STORE]
    assert stores
    before = r.sched.cost.copy_bandwidth
    while r.transfer.pending:  # a STORE to a slow backend: 1 MiB/s, nothing to do with offload's copies
        plan, ok = r.transfer.complete(0, True)
        r.sched.on_copy_complete(plan, ok, nbytes=1 << 20, seconds=1.0 if plan.kind is CopyKind.STORE else 0.0)
    assert r.sched.cost.copy_bandwidth == before


def test_auto_offloads_when_copies_are_cheaper_and_recomputes_when_not():
    fast = rig(preemption=M.AUTO, copy_bandwidth=1e12, prefill_rate=1e3)
    two_requests(fast)
    step_until_preempted(fast)
    assert fast.sched.stats.preempt_offload == 1
    slow = rig(preemption=M.AUTO, copy_bandwidth=1e12, prefill_rate=1e3)
    slow.sched.observe_copy(1 << 20, 1.0)  # measured: 1 MiB/s, so 2 x 3 blocks of 1 MiB take 6 s
    assert slow.sched.cost.copy_bandwidth == pytest.approx(1 << 20, rel=1e-3)  # less the task latency
    two_requests(slow)
    step_until_preempted(slow)
    assert slow.sched.stats.preempt_recompute == 1 and slow.sched.stats.preempt_offload == 0
    slow.run()
    assert slow.sched.cost.prefill_samples > 0  # prefill steps fed the estimate


def test_auto_prices_only_what_each_mode_would_redo_beside_write_through_host_copies():
    # Victim 1 has 10 computed tokens; write-through is putting its 2 full blocks on the host
    # (the copies go out in the step that preempts it). Offload would copy 3 blocks out and back
    # (~0.3 ms of round trips); recompute computes its last 2 tokens again (~0.1 ms at the 18000
    # tokens/s the first step measured), not all 10 (~0.6 ms), trusting its 8 host-copied tokens
    # to last: a 64-block host tier is 1/16 full, so it charges them at 1/16.
    r = rig(host=64, cache_policy=CachePolicy.WRITE_THROUGH, preemption=M.AUTO, copy_bandwidth=1e12,
            copy_latency_s=150e-6)
    two_requests(r)
    out = step_until_preempted(r)
    assert sum(len(p.src) for p in out.copies if p.kind is CopyKind.SWAP_OUT) == 4  # write-through of both
    assert r.sched.stats.preempt_recompute == 1 and r.sched.stats.preempt_offload == 0
    r.run()
    assert r.finished[1].num_recomputed_tokens == 2
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]


def test_auto_offloads_a_victim_whose_host_copies_a_full_host_tier_would_evict():
    # The same victim, but an earlier request left 4 cached blocks in an 8-block host tier, and
    # write-through fills the rest: a recompute would hold none of its host copies, and the next
    # copies would evict them, so its 8 host-copied tokens are charged at the tier's occupancy
    # (>= 1/2: ~0.4 ms in all against ~0.3 ms of copying out and back). Offloading pins them:
    # the restore recomputes nothing.
    r = rig(host=8, cache_policy=CachePolicy.WRITE_THROUGH, preemption=M.AUTO, copy_bandwidth=1e12,
            copy_latency_s=150e-6)
    r.add(9, range(100, 116), max_new_tokens=1)
    r.run()
    assert r.sched.cache.host_occupancy == pytest.approx(0.5)
    two_requests(r)
    step_until_preempted(r)
    assert r.sched.get_request(1).state is S.OFFLOADING
    assert r.sched.stats.preempt_offload == 1 and r.sched.stats.preempt_recompute == 0
    r.run()
    assert r.finished[1].num_recomputed_tokens == 0
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]


def test_per_request_mode_overrides_the_deployment():
    r = rig(preemption=M.RECOMPUTE)
    two_requests(r, preemption=M.OFFLOAD)
    step_until_preempted(r)
    assert r.sched.stats.preempt_offload == 1 and r.sched.get_request(1).state is S.OFFLOADING


def test_failed_offload_falls_back_to_recompute():
    r = rig(preemption=M.OFFLOAD)
    two_requests(r)
    step_until_preempted(r)
    r.complete_all(ok=False)
    q1 = r.sched.get_request(1)
    assert q1.state is S.WAITING and r.sched.stats.offload_failed == 1
    r.run()
    assert r.finished[1].num_recomputed_tokens > 0
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]


def test_failed_restore_recomputes_from_the_first_spoiled_block():
    r = rig(preemption=M.OFFLOAD, cache_policy=CachePolicy.WRITE_THROUGH_SELECTIVE)  # no write-backs
    two_requests(r)
    step_until_preempted(r)
    q1 = r.sched.get_request(1)
    r.complete_all()
    while q1.state is not S.LOADING:
        r.step()
    (swap_in,) = [p for p, _ in r.transfer.pending]
    assert swap_in.kind is CopyKind.SWAP_IN  # blocks still cached on the device are reused, not copied
    first = r.sched.cache.block_table(1).tolist().index(int(swap_in.dst[0]))
    r.complete(0, ok=False)
    assert q1.state is S.RUNNING and q1.num_computed_tokens == first * BS
    assert r.sched.stats.load_shortfalls == 1
    r.run()
    assert r.finished[1].num_recomputed_tokens == 10 - first * BS
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]


def test_no_host_room_recomputes():
    r = rig(host=2, preemption=M.OFFLOAD)
    two_requests(r)
    step_until_preempted(r)
    assert r.sched.get_request(1).state is S.WAITING and r.sched.stats.offload_no_room == 1
    r.run()


def test_priority_policy_preempts_the_least_important_even_if_it_is_the_one_growing():
    r = rig(host=0, policy=QueuePolicy.PRIORITY)
    r.add(0, range(1, 9), max_new_tokens=8, priority=1)
    r.add(1, range(20, 30), max_new_tokens=8, priority=0)
    step_until_preempted(r, rid=0)
    assert r.sched.get_request(0).state is S.WAITING and r.sched.get_request(1).num_preemptions == 0
    r.run()
    assert set(r.finished) == {0, 1}


def test_a_victim_already_in_this_steps_plan_is_taken_out_of_it():
    r = rig(host=0, policy=QueuePolicy.PRIORITY)
    r.add(0, range(1, 6), max_new_tokens=8, priority=1)  # in the plan first, then the victim
    r.add(1, range(20, 32), max_new_tokens=8, priority=0)  # 12 tokens: grows at its first decode
    out = step_until_preempted(r, rid=0)
    assert [s.request_id for s in out.plan.seqs] == [1]
    r.run()


def test_stalls_for_an_offload_that_never_completes_are_bounded_by_patience():
    """An offload that never completes: the request waiting for its blocks stalls
    ``copy_patience_steps`` steps, then preempts by recompute instead of waiting forever."""
    # (no write-backs: with WRITE_BACK, taking a cached block waits for its copy to the host)
    r = rig(dev=8, preemption=M.OFFLOAD, copy_patience_steps=3, cache_policy=CachePolicy.WRITE_THROUGH_SELECTIVE)
    r.add(0, range(1, 9), max_new_tokens=8)
    r.add(1, range(20, 30), max_new_tokens=8)
    r.add(2, range(40, 50), max_new_tokens=8)
    for _ in range(40):  # copies never complete
        r.step()
        if 0 in r.finished:
            break
    assert 0 in r.finished and r.finished[0].state is S.FINISHED_LENGTH
    assert r.sched.stats.stalls >= 3 and r.sched.get_request(1).mode_used is M.RECOMPUTE
    offloading = [q for q in r.sched.requests.values() if q.state is S.OFFLOADING]
    assert offloading and all(q.num_computed_tokens for q in offloading)
    r.complete_all()
    r.run()
    assert set(r.finished) == {0, 1, 2}
    for i, n in ((0, 8), (1, 10), (2, 10)):
        assert r.finished[i].output_token_ids == r.worker.truth[i].tokens[n:]


@pytest.mark.parametrize("storage", [False, True])
@pytest.mark.parametrize("cache_policy", list(CachePolicy))
def test_a_restore_preempted_while_loading_goes_back_to_offloaded_and_resumes_exactly(cache_policy, storage):
    """Request 1 is offloaded, then restored; while its swap-in is in flight, the more important
    request 2 needs a block and picks 1 as the victim. 1's host copies are intact: it goes back to
    OFFLOADED (no copy, nothing recomputed) instead of dropping its KV and recomputing.

    The finding sched-restore-inexact (write-back, a storage tier) was this path: the restore was
    preempted by recompute and re-admitted on its 4-token prefix hit in the same step, so it
    came back RUNNING with 4 of its 7 computed tokens."""
    r = rig(dev=7, preemption=M.OFFLOAD, policy=QueuePolicy.PRIORITY, cache_policy=cache_policy, storage=storage)
    r.add(0, range(1, 9), max_new_tokens=12)
    r.add(1, range(20, 30), max_new_tokens=8, priority=1)
    q1 = r.sched.get_request(1)
    for _ in range(30):  # offloaded under 0's growth, restored once 0 is done
        r.step()
        if q1.state is S.LOADING:
            break
        r.complete_all()
    computed = q1.num_computed_tokens
    assert q1.num_restores == 1 and computed % BS
    # its swap-in, or under write-back the write-back of a block it took, ahead of the swap-in
    assert {p.kind for p, _ in r.transfer.pending} & {CopyKind.SWAP_IN, CopyKind.SWAP_OUT}
    r.add(2, range(40, 51), max_new_tokens=8)  # 3 blocks now, a 4th at its second decode
    for _ in range(5):
        r.step()
        if q1.state is not S.LOADING:
            break
        others = [i for i, (p, _) in enumerate(r.transfer.pending) if p.kind is not CopyKind.SWAP_IN]
        for i in reversed(others):  # write-backs and stores land; the restore's swap-in doesn't
            r.complete(i)
    assert q1.state is S.OFFLOADED and q1.num_computed_tokens == computed
    assert r.sched.cache.num_computed_tokens(1) == computed
    r.complete_all()  # the cancelled copies land in blocks 1 no longer holds: nothing changes for 1
    assert q1.state is S.OFFLOADED
    r.run()
    assert q1.num_restores == 2
    assert r.finished[1].num_recomputed_tokens == 0 and r.sched.stats.recomputed_tokens == 0
    for i, n in ((0, 8), (1, 10), (2, 11)):
        assert r.finished[i].output_token_ids == r.worker.truth[i].tokens[n:]
