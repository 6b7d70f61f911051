"""Preemption by offload for a sliding-window hybrid layout: ``GroupedManager``'s per-group copy
plans (``fastkv.cache.group_tiers``, ``fastkv.cache.group_copies``) through the scheduler, with
the synthetic runner on real numpy caches.

The test executes each plan as the transfer process would: a group's SWAP moves that group's
layers only, between its device tensors and its own host array. A block copied to the wrong
place, a group's block missing from the restore, or a copy moving another group's layers
changes the bytes the runner verifies before every step, hence the tokens; outputs must equal
``reference_output`` with the groups' windows.
"""
import numpy as np
import pytest

from fastkv.cache.group_manager import GroupedManager
from fastkv.cache.manager import CacheConfig
from fastkv.cache.plan import CopyKind, CopyPlan, task_of, wire_fields
from fastkv.cache.requests import ReqState
from fastkv.config import cdiv
from fastkv.engine.metrics import EngineMetrics
from fastkv.engine.runners.synthetic import SyntheticRunner, reference_output
from fastkv.sched import PreemptionMode, Request, Scheduler, SchedulerConfig
from tests.sched_harness import run_step
from tests.unit.sched.test_groups_synthetic import LAYOUT, WINDOW, caches, prompts

BOUND = cdiv(WINDOW, LAYOUT.block_size) + 1  # a sliding group's blocks per request between steps


class GroupHosts:
    """Per group a host array [blocks, group's layers, 2, ...]: what a SWAP of that group moves."""

    def __init__(self, k, v, host_blocks, poison=True):
        self.k, self.v, self.poison = k, v, poison
        self.groups = LAYOUT.groups
        self.host = [np.full((n, len(g.layers), 2, *LAYOUT.device_shape(1)[1:]), 77, LAYOUT.numpy_dtype)
                     for g, n in zip(self.groups, host_blocks, strict=True)]
        self.swapped = []  # (kind, group, blocks)

    def run(self, plan: CopyPlan) -> None:
        assert plan.kind in (CopyKind.SWAP_OUT, CopyKind.SWAP_IN) and plan.group >= 0, plan
        plan = task_of(plan.plan_id, plan.kind, *wire_fields(plan))  # as it travels
        host = self.host[plan.group]
        for j, layer in enumerate(self.groups[plan.group].layers):
            for page, t in enumerate((self.k[layer], self.v[layer])):
                if plan.kind is CopyKind.SWAP_OUT:
                    host[plan.dst, j, page] = t[plan.src]
                    if self.poison:  # dead once offloaded: a restore must bring them (a failed offload keeps them)
                        t[plan.src] = 55
                else:
                    t[plan.dst] = host[plan.src, j, page]
        self.swapped.append((plan.kind, plan.group, plan.num_blocks))


def serve(group_blocks, host_blocks, max_new=12, chunk=16, n=8, fail=(), mode=PreemptionMode.OFFLOAD):
    k, v = caches(group_blocks)
    runner = SyntheticRunner(LAYOUT, 0, 1, k, v, vocab=97, verify="all")
    cache = GroupedManager(CacheConfig(num_device_blocks=max(group_blocks), block_size=LAYOUT.block_size,
                                       layout=LAYOUT), group_blocks, chunk, host_group_blocks=host_blocks)
    sched = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=chunk, preemption=mode))
    hosts = GroupHosts(k, v, host_blocks, poison=not fail)
    ps = prompts(n)
    for rid, p in enumerate(ps):
        sched.add_request(Request(rid, np.array(p, np.int32), max_new))
    outputs, copies = {}, 0
    for _ in range(3000):
        if not sched.has_work():
            break
        out = sched.step()
        for plan in out.copies:
            copies += 1
            ok = copies not in fail
            if ok:
                hosts.run(plan)
            sched.on_copy_complete(plan.plan_id, ok)
        run_step(sched, runner, out, outputs)
        sched.check_integrity()
    else:
        raise AssertionError("the scheduler did not finish")
    for r in sched.take_finished():
        outputs[r.request_id] = r.output_token_ids
    windows = [g.window for g in LAYOUT.groups]
    want = {rid: reference_output(p, max_new, 97, LAYOUT.dtype, windows=windows) for rid, p in enumerate(ps)}
    assert not cache.request_ids() and not cache.copies_in_flight()
    return outputs, want, sched, cache, runner, hosts


def test_offload_preemption_restores_every_group_exactly():
    outputs, want, sched, cache, runner, hosts = serve([12, 12], [40, 40])
    assert outputs == want
    assert sched.stats.preempt_offload > 0 and sched.stats.restored > 0, "no offload under pressure"
    assert sched.stats.preempt_recompute == 0
    assert runner.checks()["kv_blocks_verified"] > 0
    sliding = {i for i, g in enumerate(LAYOUT.groups) if g.window}
    outs = [(g, n) for kind, g, n in hosts.swapped if kind is CopyKind.SWAP_OUT]
    assert {g for g, _ in outs} == {0, 1}, "each group offloads its own blocks"
    assert all(n <= BOUND for g, n in outs if g in sliding), f"a sliding group copied more than its window: {outs}"
    assert max(n for g, n in outs if g not in sliding) > BOUND, "no long request offloaded"
    for gp in cache.groups.groups:
        assert gp.host.num_free == gp.host.capacity
    blocks = EngineMetrics(sched).blocks()  # the health endpoint's and Prometheus' block counts
    assert sorted(blocks) == ["group 0 device", "group 0 host", "group 1 device", "group 1 host"], blocks
    assert blocks["group 1 host"] == {"free": 40, "allocated": 0, "cached": 0, "in_flight": 0}


def test_failed_copies_fall_back_to_recompute_and_stay_exact():
    outputs, want, sched, *_ = serve([12, 12], [40, 40], fail=(1, 4, 7))
    assert outputs == want
    assert sched.stats.copies_failed == 3


def test_auto_preemption_weighs_a_groups_copy_by_its_layers_and_stays_exact():
    cache = manager()
    run_long(cache)
    work = cache.preemption_work(0)
    held = cache.groups.held_blocks(0)  # two layers in each group, of four: half a block each
    assert work.copy_blocks == cdiv(sum(held), 2) and work.recompute_tokens == 37 and work.unheld_tokens == 0
    outputs, want, sched, *_ = serve([12, 12], [40, 40], mode=PreemptionMode.AUTO)
    assert outputs == want
    assert sched.stats.preempt_offload + sched.stats.preempt_recompute > 0


def test_a_host_pool_without_room_recomputes():
    outputs, want, sched, *_ = serve([12, 12], [2, 2])
    assert outputs == want
    assert sched.stats.offload_no_room > 0 and sched.stats.preempt_recompute > 0


# ---- the manager's plans, one request at a time
def manager(host=(20, 20)):
    return GroupedManager(CacheConfig(num_device_blocks=30, block_size=LAYOUT.block_size, layout=LAYOUT),
                          (30, 30), 8, host_group_blocks=host)


def run_long(cache, rid=0, n=37):
    """A prompt of ``n`` tokens computed in chunks of 8: the sliding group holds its tail only."""
    cache.allocate(rid, np.arange(1, n + 1, dtype=np.int32))
    done = 0
    while done < n:
        step = min(8, n - done)
        assert cache.step_table(rid, done, step) is not None
        done += step
        cache.mark_computed(rid, done)


def test_an_offload_copies_a_sliding_groups_window_tail_and_every_full_block():
    cache = manager()
    run_long(cache)
    tables = [t.copy() for t in cache.groups.tables(0)]
    plans = cache.offload(0)
    assert cache.request_state(0) is ReqState.OFFLOADING and not cache.is_ready(0)
    by_group = {p.group: p for p in plans}
    for i, g in enumerate(LAYOUT.groups):
        p = by_group[i]
        assert p.kind is CopyKind.SWAP_OUT
        held = tables[i][tables[i] >= 0]
        assert p.src.tolist() == held.tolist(), f"group {i} copies the blocks its table holds, in block order"
        if g.window:
            assert len(held) <= BOUND
        else:
            assert len(held) == cdiv(37, LAYOUT.block_size)
    assert cache.copies_in_flight() == {p.plan_id for p in plans}
    assert cache.complete(plans[0], True).offloaded == ()  # the request waits for every group's copy
    c = cache.complete(plans[1], True)
    assert c.offloaded == (0,) and cache.is_offloaded(0)
    assert [gp.pool.num_allocated for gp in cache.groups.groups] == [0, 0]
    a = cache.restore(0, reserve_tokens=1)
    assert not a.ready and a.num_pending_tokens == 37
    back = {p.group: p for p in a.plans}
    for i in range(len(LAYOUT.groups)):
        assert back[i].kind is CopyKind.SWAP_IN
        assert back[i].src.tolist() == by_group[i].dst.tolist(), "a restore reads the blocks the offload wrote"
    assert cache.is_restoring(0) and not cache.is_ready(0)
    cache.complete(a.plans[0], True)
    c = cache.complete(a.plans[1], True)
    assert c.ready[0].request_id == 0 and c.ready[0].num_computed_tokens == 37 and cache.is_ready(0)
    after = cache.groups.tables(0)
    for i in range(len(LAYOUT.groups)):
        assert ((after[i] >= 0) == (tables[i] >= 0)).all(), "the same block numbers, in fresh blocks"
    assert cache.append_slots(0, [5]) is not None  # the reserved token's slot
    cache.check_integrity()
    cache.free(0)
    assert all(gp.host.num_free == gp.host.capacity for gp in cache.groups.groups)


def test_a_restore_preempted_in_flight_is_offloaded_again_once_it_lands():
    cache = manager()
    run_long(cache)
    for p in cache.offload(0):
        cache.complete(p, True)
    a = cache.restore(0)
    assert cache.offload(0) == () and cache.is_offloaded(0) and not cache.is_restoring(0)
    assert cache.restore(0) is None, "its copies still write device blocks"
    for p in a.plans:
        c = cache.complete(p, True)
        assert not (c.ready or c.offloaded or c.offload_failed), "a cancelled restore readies nothing"
    assert cache.is_offloaded(0) and [gp.pool.num_allocated for gp in cache.groups.groups] == [0, 0]
    assert cache.restore(0) is not None
    cache.check_integrity()


def test_a_request_freed_while_its_copies_fly_is_let_go_of_when_they_land():
    cache = manager()
    run_long(cache)
    plans = cache.offload(0)
    cache.free(0)
    assert cache.request_ids() == [] and cache.copies_in_flight()
    with pytest.raises(ValueError, match="double free"):
        cache.free(0)
    for p in plans:
        assert not cache.complete(p, True).offloaded
    assert not cache.copies_in_flight() and not cache.groups.request_ids()
    assert all(gp.host.num_free == gp.host.capacity for gp in cache.groups.groups)
    cache.check_integrity()


def test_a_failed_restore_recomputes_from_the_start():
    cache = manager()
    run_long(cache)
    for p in cache.offload(0):
        cache.complete(p, True)
    a = cache.restore(0)
    cache.complete(a.plans[0], False)
    c = cache.complete(a.plans[1], True)
    assert c.ready[0].num_computed_tokens == 0 and cache.num_computed_tokens(0) == 0
    assert cache.stats.failed_copies == 1
    cache.check_integrity()


def test_without_a_host_tier_an_offload_is_refused_in_one_line():
    cache = manager(host=())
    run_long(cache)
    assert not cache.has_host_tier
    with pytest.raises(ValueError, match="needs a host tier"):
        cache.offload(0)


def test_a_group_swap_travels_with_its_group_and_an_all_full_one_as_before():
    plan = CopyPlan(3, CopyKind.SWAP_IN, [1, 2], [4, 5], group=1)
    src, dst, keys = wire_fields(plan)
    back = task_of(3, CopyKind.SWAP_IN, src, dst, keys)
    assert back.group == 1 and back.src.tolist() == [1, 2] and back.dst.tolist() == [4, 5]
    assert wire_fields(CopyPlan(3, CopyKind.SWAP_OUT, [1], [2]))[2] == ()
    assert task_of(3, CopyKind.SWAP_OUT, [1], [2]).group == -1
    with pytest.raises(ValueError, match="group"):
        CopyPlan(3, CopyKind.STORE, [1], [], (b"k",), group=0)
    with pytest.raises(ValueError, match="keys"):
        task_of(3, CopyKind.SWAP_OUT, [1], [2], (b"junk",))
