"""Weight update: pause admission, drain or preempt, clear the caches, resume under a new namespace."""
import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.sched import PreemptionMode, RequestState, Scheduler, SchedulerConfig, WeightUpdate
from tests.sched_harness import Rig

BS = 4
S = RequestState
W = WeightUpdate
PROMPT = list(range(1, 10))


def rig(**kw) -> Rig:
    cache = CacheManager(CacheConfig(num_device_blocks=5, num_host_blocks=8, block_size=BS,
                                     policy=CachePolicy.WRITE_BACK))
    return Rig(Scheduler(cache, SchedulerConfig(**kw)))


def test_drain_lets_running_requests_finish_then_clears_and_resumes_under_new_weights():
    r = rig()
    s = r.sched
    r.add(0, PROMPT, max_new_tokens=3)
    r.step()
    s.begin_weight_update(drain=True)
    r.add(1, PROMPT, max_new_tokens=2)  # same prompt: would hit the cache under the old weights
    kinds = []
    while s.weight_update_state is W.DRAINING:
        out = r.step()
        kinds += [p.kind for p in out.copies]
        assert 1 not in [q.request_id for q in out.plan.seqs]
        r.complete_all()
    assert 0 in r.finished and r.finished[0].state is S.FINISHED_LENGTH and CopyKind.CLEAR in kinds
    assert s.weight_update_state is W.READY and s.get_request(1).state is S.WAITING
    with pytest.raises(ValueError, match="in progress"):
        s.begin_weight_update()
    s.finish_weight_update("v2")
    out = r.step()
    assert [p.kind for p in out.copies] == [CopyKind.RESTORE]
    assert [(q.request_id, q.start_pos) for q in out.plan.seqs] == [(1, 0)]  # no hit on old KV
    r.complete_all()
    r.run()
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[9:]


def test_without_drain_everything_on_the_device_or_host_is_preempted_to_recompute():
    r = rig(preemption=PreemptionMode.OFFLOAD)
    s = r.sched
    r.add(0, range(1, 9), max_new_tokens=8)
    r.add(1, range(20, 30), max_new_tokens=8)
    while not s.stats.preempt_offload:
        r.step()
        r.complete_all()
    r.complete_all()
    assert s.get_request(1).state is S.OFFLOADED
    s.begin_weight_update(drain=False)
    out = r.step()
    assert out.plan.seqs == [] and [p.kind for p in out.copies] == [CopyKind.CLEAR]
    assert all(q.state is S.WAITING and q.num_computed_tokens == 0 for q in s.requests.values())
    assert s.cache.request_ids() == []
    r.complete_all()
    assert s.weight_update_state is W.READY
    s.finish_weight_update("v2")
    r.run()
    assert set(r.finished) == {0, 1}
    for rid, n in ((0, 8), (1, 10)):
        assert r.finished[rid].output_token_ids == r.worker.truth[rid].tokens[n:]


def test_clear_waits_for_copies_in_flight():
    r = rig()
    s = r.sched
    r.add(0, PROMPT, max_new_tokens=1)
    r.run()
    r.add(1, range(40, 56), max_new_tokens=1)  # evicts 0's cached blocks: write-backs in flight
    r.step()
    assert r.transfer.pending
    s.begin_weight_update(drain=False)
    assert [p.kind for p in r.step().copies] == []
    r.complete_all()
    assert [p.kind for p in r.step().copies] == [CopyKind.CLEAR]
    with pytest.raises(ValueError, match="expected READY"):
        s.finish_weight_update("v2")
    r.complete_all()
    s.finish_weight_update("v2")
    r.run()
    assert set(r.finished) == {0, 1}


def test_clear_waits_for_prefill_exports_holding_device_blocks():
    """A prefill export whose copy failed holds its device blocks for a retry; a CLEAR before
    it is over would let the retry copy cleared memory under the old weights' keys."""
    from fastkv.cache import handoff

    def drain(plans, ok=True):
        plans = list(plans)
        while plans:
            plans += cache.complete(plans.pop(), ok).plans

    cache = CacheManager(CacheConfig(num_device_blocks=8, num_host_blocks=8, block_size=BS,
                                     policy=CachePolicy.WRITE_BACK, storage=True))
    r = Rig(Scheduler(cache, SchedulerConfig()))
    s = r.sched
    tokens = list(range(100, 111))
    drain(cache.allocate("x", tokens).plans)
    drain(cache.mark_computed("x", len(tokens)))
    keys, plans = handoff.export(cache.state, "x", len(tokens) - 1, b"t" * 32)
    cache.free("x")
    drain(plans, ok=False)  # the copies failed: the export holds its blocks for a retry
    assert cache.num_export_holds == len(keys) and handoff.exported(cache.state, keys) is False
    s.begin_weight_update(drain=False)
    assert CopyKind.CLEAR not in [p.kind for p in r.step().copies]
    assert s.weight_update_state is W.DRAINING
    handoff.release(cache.state, keys)  # given up (or stored)
    assert [p.kind for p in r.step().copies] == [CopyKind.CLEAR]
