"""Liveness: copies that never complete stall only the requests that wait for them.

A prefix P is first put on the host tier (write-through, then evicted from the device) while
the transfer layer works; then the transfer layer dies: nothing it was given completes.
"""
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.pool import BlockState
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.sched import PreemptionMode, RequestState, Scheduler, SchedulerConfig
from tests.sched_harness import Rig

BS = 4
S = RequestState
P = list(range(100, 112))  # three full blocks


def seeded(dev=16, **kw) -> Rig:
    cache = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=2 * dev, block_size=BS,
                                     policy=CachePolicy.WRITE_THROUGH))
    r = Rig(Scheduler(cache, SchedulerConfig(**kw)))
    r.add(1000, P, max_new_tokens=1)
    r.run()
    filler = 1001
    while cache.match(P).device_blocks:  # evict P from the device; the host keeps its copies
        r.add(filler, range(filler, filler + 3 * BS), max_new_tokens=1)
        filler += 1
        r.run()
    assert cache.match(P).host_blocks and not r.transfer.pending
    return r


def test_a_dead_transfer_layer_stalls_only_the_requests_waiting_for_its_copies():
    r = seeded(max_loading_blocks=2, preemption=PreemptionMode.OFFLOAD)
    s = r.sched
    r.add(0, P + [1, 2], max_new_tokens=4)  # host hit: waits for a swap-in that never completes
    r.add(1, P + [3], max_new_tokens=4)  # host hit too: deferred, loads already hold the bound
    for i in range(2, 6):
        r.add(i, range(10 * i, 10 * i + 6), max_new_tokens=4)  # no hit: must run and finish
    for _ in range(30):
        r.step()  # nothing the transfer layer was given ever completes
    assert set(r.finished) >= {2, 3, 4, 5}
    assert s.get_request(0).state is S.LOADING and s.get_request(1).state is S.WAITING
    assert s.stats.deferred_loads > 0
    assert any(p.kind is CopyKind.SWAP_IN for p, _ in r.transfer.pending)
    assert s.abort(0) and s.get_request(0) is None  # a LOADING request can be aborted
    r.step()
    assert r.finished[0].state is S.FINISHED_ABORTED
    # its swap-in destinations stay IN_FLIGHT (the copy may still write them) until it completes
    assert s.cache.device.num_in_flight > 0
    r.complete_all()
    r.run()
    assert set(r.finished) >= {0, 1, 2, 3, 4, 5} and not s.has_work()


def step_hanging_loads(r: Rig) -> None:
    """A step whose write-through copies land, while swap-ins hang forever."""
    r.step()
    i = 0
    while i < len(r.transfer.pending):
        if r.transfer.pending[i][0].kind is CopyKind.SWAP_IN:
            i += 1
        else:
            r.complete(i)


def test_a_loading_request_is_preempted_when_running_requests_need_its_blocks():
    r = seeded(dev=8, max_num_batched_tokens=64)
    s = r.sched
    r.add(0, range(1, 15), max_new_tokens=5)  # 14 tokens, 4 blocks; grows past 16 (5 blocks at most)
    step_hanging_loads(r)
    r.add(1, P + [1], max_new_tokens=2)  # 4 blocks: 3 swapped in (never), 1 fresh
    step_hanging_loads(r)
    assert s.get_request(1).state is S.LOADING
    for _ in range(20):
        step_hanging_loads(r)
        if s.get_request(1).state is not S.LOADING:
            break
    q1 = s.get_request(1)
    assert q1.state is S.WAITING and q1.num_preemptions == 1 and q1.mode_used is PreemptionMode.RECOMPUTE
    for _ in range(20):
        step_hanging_loads(r)
    assert 0 in r.finished  # it grew into the blocks the loading request gave back
    dev = s.cache.device
    stuck = [p for p, _ in r.transfer.pending if p.kind is CopyKind.SWAP_IN]
    assert stuck and all(dev.block_state(int(b)) is BlockState.IN_FLIGHT for p in stuck for b in p.dst)
    r.complete_all()
    r.run()
    assert set(r.finished) >= {0, 1}
