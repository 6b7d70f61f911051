"""A rank's two lanes (fastkv.transfer.lanes): a slow STORE does not hold up swaps, tasks on
the same host blocks keep their order, a LOAD overlaps the SWAP_IN behind it, barriers wait
for both lanes, a bad message still fails its own task, and a killed process fails exactly
the tasks it had in either lane."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.ipc import TaskMsg
from fastkv.ipc.native import A
from fastkv.ipc.ring import HEADER, OFF_HEAD
from fastkv.run import attach_transfer
from fastkv.transfer.executor import TaskExecutor
from fastkv.transfer.lanes import GIL_SWITCH_S, STORAGE_NICE, HostHolds, StorageLane
from fastkv.transfer.process import EngineGone, TransferLoop
from tests.optional import require_paddle
from tests.transfer.helpers import (
    SlowStore,
    Supervisor,
    device_blocks,
    fill_random,
    key,
    plan,
    pump,
    run_tasks,
    set_device_blocks,
    wait_ready,
)

require_paddle()
pytestmark = pytest.mark.timeout(300)
LAYOUT = KVLayout(1, 1, 16, 16, "float32", tp_size=1)


@contextmanager
def serving(tmp_path, *, start: bool = True, before_get=None):
    """transfer[0]'s loop on a thread of this process, over LMDB behind a ``SlowStore``
    (``per_block_s`` 0 until a test slows it)."""
    sup = Supervisor(layout=LAYOUT, num_device_blocks=16, num_host_blocks=32, storage_url=f"lmdb://{tmp_path}")
    ends = executor = loop = server = None
    try:
        client = sup.engine(kill_late=False)
        ends = attach_transfer(sup.ns, sup.spec, 0)
        executor = TaskExecutor(sup.spec, 0)
        executor.store = slow = SlowStore(executor.store, 0.0, before_get)
        loop = TransferLoop(sup.spec, 0, ends, executor)
        assert client.ready()
        server = threading.Thread(target=loop.run)
        fill_random(sup.devices[0], np.random.default_rng(5))
        fill_random(sup.hosts[0], np.random.default_rng(6))
        if start:
            server.start()
        yield sup, client, slow, server
    finally:
        if sup.ends is not None:
            sup.signals["stop"] = 1
        if server is not None and server.is_alive():
            server.join(30)
        if loop is not None:
            loop.close()
            assert not any(t.name == "transfer0-storage" for t in threading.enumerate()), "storage lane left running"
        if ends is not None:
            ends.close()
        if executor is not None:
            executor.close()
        sup.close()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality (random float bits include NaNs)."""
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def finish_order(sup, client, plans, timeout=30.0, submit=True):
    """Submits ``plans`` back to back; their results and the order the results came in."""
    for p in plans if submit else ():
        client.submit(p)
    order = []
    got = pump(sup, client, [p.plan_id for p in plans], timeout, on_result=lambda r: order.append(r.plan.plan_id))
    return [got[p.plan_id] for p in plans], order


def test_a_slow_store_does_not_hold_up_a_swap_in_and_acks_come_out_of_order(tmp_path):
    with serving(tmp_path) as (sup, client, slow, _):
        slow.per_block_s = 0.5
        host, dev = sup.hosts[0], sup.devices[0]
        store = plan(CopyKind.STORE, range(4), [], [key(i) for i in range(4)])  # 2 s
        swap_in = plan(CopyKind.SWAP_IN, [8], [3])
        t0 = time.monotonic()
        client.submit(store)
        client.submit(swap_in)
        took = {}
        order = []

        def seen(res):
            took[res.plan.plan_id] = time.monotonic() - t0
            order.append(res.plan.plan_id)

        got = pump(sup, client, [store.plan_id, swap_in.plan_id], on_result=seen)
        assert got[store.plan_id].ok and got[swap_in.plan_id].ok, (got[store.plan_id].error, got[swap_in.plan_id].error)
        assert order == [swap_in.plan_id, store.plan_id], "the SWAP_IN waited for the STORE sent before it"
        assert took[swap_in.plan_id] < took[store.plan_id] / 2, took
        assert got[swap_in.plan_id].plan is swap_in and got[store.plan_id].nbytes == 4 * LAYOUT.block_bytes
        assert same(dev.k_arrays[0][3], host.array[8, 0, 0])


def test_a_swap_in_of_host_blocks_a_slow_store_is_reading_does_not_wait_for_it(tmp_path):
    """Both only read the host blocks: nothing to order."""
    with serving(tmp_path) as (sup, client, slow, _):
        slow.per_block_s = 0.5
        store = plan(CopyKind.STORE, range(4), [], [key(i, "rr") for i in range(4)])
        swap_in = plan(CopyKind.SWAP_IN, [3], [3])  # block 3 is the STORE's last part, read at ~1.5 s
        results, order = finish_order(sup, client, [store, swap_in])
        assert all(r.ok for r in results), [r.error for r in results]
        assert order == [swap_in.plan_id, store.plan_id]
        assert same(sup.devices[0].k_arrays[0][3], sup.hosts[0].array[3, 0, 0])


def test_a_store_after_the_swap_out_that_fills_its_blocks_stores_the_swapped_bytes(tmp_path):
    with serving(tmp_path) as (sup, client, slow, _):
        slow.per_block_s = 0.1
        want = device_blocks(sup.devices[0], [1, 2])
        out = plan(CopyKind.SWAP_OUT, [1, 2], [5, 6])
        store = plan(CopyKind.STORE, [5, 6], [], [key(5), key(6)])
        load = plan(CopyKind.LOAD, [], [20, 21], [key(5), key(6)])
        back = plan(CopyKind.SWAP_IN, [20, 21], [9, 10])
        results, _ = finish_order(sup, client, [out, store, load, back])  # sent back to back, no waiting
        assert all(r.ok for r in results), [r.error for r in results]
        for got, exp in zip(device_blocks(sup.devices[0], [9, 10]), want, strict=True):
            assert same(got, exp)


def test_a_swap_out_waits_for_a_slow_store_still_reading_its_host_blocks(tmp_path):
    """The SWAP_OUT is sent after the STORE: the STORE must store the bytes from before it."""
    with serving(tmp_path) as (sup, client, slow, _):
        slow.per_block_s = 0.3
        host = sup.hosts[0]
        before = host.array[[0, 1, 2]].copy()
        store = plan(CopyKind.STORE, [0, 1, 2], [], [key(i, "old") for i in range(3)])
        out = plan(CopyKind.SWAP_OUT, [10, 11, 12], [0, 1, 2])
        client.submit(store)
        client.submit(out)
        t0, took = time.monotonic(), {}
        got = pump(sup, client, [store.plan_id, out.plan_id],
                   on_result=lambda r: took.setdefault(r.plan.plan_id, time.monotonic() - t0))
        assert got[store.plan_id].ok and got[out.plan_id].ok, (got[store.plan_id].error, got[out.plan_id].error)
        # It waited for the STORE to read all three blocks (0.3 s each). It may still ack first: the
        # STORE frees each block as it is read, and its niced thread returns and acks after the last.
        assert took[out.plan_id] >= 0.8, took
        slow.per_block_s = 0.0
        load, = run_tasks(sup, client, plan(CopyKind.LOAD, [], [20, 21, 22], [key(i, "old") for i in range(3)]))
        assert load.ok, load.error
        assert same(host.array[[20, 21, 22]], before), "the STORE stored bytes the SWAP_OUT wrote"
        for i, d in enumerate([10, 11, 12]):
            assert same(host.array[i, 0, 0], sup.devices[0].k_arrays[0][d])


def test_a_swap_in_behind_a_load_copies_block_i_while_block_i_plus_1_loads(tmp_path):
    expected, seen = {}, []

    def before_get(block_ids):  # the LOAD's parts: [20], [21, 22], [23]
        if 23 in list(block_ids):
            seen.append(same(sup.devices[0].k_arrays[0][4], expected[20]))

    with serving(tmp_path, before_get=before_get) as (sup, client, slow, _):
        host = sup.hosts[0]
        stored, = run_tasks(sup, client, plan(CopyKind.STORE, range(4), [], [key(i, "pipe") for i in range(4)]))
        assert stored.ok, stored.error
        for i in range(4):
            expected[20 + i] = host.array[i, 0, 0].copy()
        set_device_blocks(sup.devices[0], range(4, 8), 0)
        slow.per_block_s = 0.3
        load = plan(CopyKind.LOAD, [], range(20, 24), [key(i, "pipe") for i in range(4)])
        swap_in = plan(CopyKind.SWAP_IN, range(20, 24), range(4, 8))
        # the acks may come in either order: the SWAP_IN's last part runs as soon as the LOAD's
        # last part lets its block go, before the storage thread sends the LOAD's ack (seen
        # beside another fastkv run); what it copied and when is checked below
        results, _ = finish_order(sup, client, [load, swap_in])
        assert all(r.ok for r in results), [r.error for r in results]
        for i in range(4):
            assert same(sup.devices[0].k_arrays[0][4 + i], expected[20 + i])
        assert seen == [True], "block 20 was not on the device while block 23 was loading"


def test_a_swap_in_of_a_block_its_load_missed_fails_instead_of_copying_stale_bytes(tmp_path):
    with serving(tmp_path) as (sup, client, slow, _):
        stored, = run_tasks(sup, client, plan(CopyKind.STORE, [0], [], [key(0, "miss")]))
        assert stored.ok, stored.error
        set_device_blocks(sup.devices[0], [4, 5], 0)
        slow.per_block_s = 0.2
        load = plan(CopyKind.LOAD, [], [20, 21], [key(0, "miss"), key(1, "never stored")])
        swap_in = plan(CopyKind.SWAP_IN, [20, 21], [4, 5])
        (loaded, swapped), _ = finish_order(sup, client, [load, swap_in])
        assert not loaded.ok and "host blocks [21]" in loaded.error, loaded.error
        assert not swapped.ok and "host blocks [21] changed since they landed" in swapped.error, swapped.error
        assert not sup.devices[0].k_arrays[0][5].any(), "stale host bytes reached the device"


def test_clear_waits_for_the_storage_lane(tmp_path):
    with serving(tmp_path) as (sup, client, slow, _):
        slow.per_block_s = 0.3
        store = plan(CopyKind.STORE, range(4), [], [key(i, "clear") for i in range(4)])
        clear = plan(CopyKind.CLEAR)
        (stored, cleared), order = finish_order(sup, client, [store, clear])
        assert stored.ok and cleared.ok, (stored.error, cleared.error)
        assert order == [store.plan_id, clear.plan_id]


def test_a_bad_message_behind_a_slow_store_fails_itself_not_the_store(tmp_path):
    with serving(tmp_path, start=False) as (sup, client, slow, server):
        slow.per_block_s = 0.3
        store = plan(CopyKind.STORE, range(3), [], [key(i, "bad") for i in range(3)])
        first = plan(CopyKind.SWAP_OUT, [0], [10])
        client.submit(store)
        client.submit(first)
        ring = sup.ends.tasks[0].ring
        head = A.load(ring.hdr + OFF_HEAD)
        bad, last = plan(CopyKind.SWAP_OUT, [1], [11]), plan(CopyKind.SWAP_OUT, [2], [12])
        client.submit(bad)
        client.submit(last)
        ring._mm[HEADER + head % ring.nslots * ring.slot_size + 4] ^= 0xFF  # the bad task's frame seq
        server.start()
        results, _ = finish_order(sup, client, [store, first, bad, last], submit=False)
        assert [r.ok for r in results] == [True, True, False, True], [r.error for r in results]
        assert results[2].error.startswith("rank 0: bad task message: "), results[2].error


def test_a_killed_process_fails_exactly_the_tasks_in_both_lanes_and_a_restart_serves(tmp_path):
    sup = Supervisor(layout=LAYOUT, num_device_blocks=16, num_host_blocks=32, storage_url=f"lmdb://{tmp_path}")
    try:
        client = sup.engine()
        sup.start(0, per_block_s=0.5)
        wait_ready(client)
        fill_random(sup.devices[0], np.random.default_rng(8))
        done, = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [0, 1], [0, 1]))
        assert done.ok, done.error
        old_pid = sup.procs[0].pid
        store = plan(CopyKind.STORE, range(8), [], [key(i, "kill") for i in range(8)])  # 4 s in the storage lane
        waiting = plan(CopyKind.SWAP_OUT, [8], [7])  # waits in the swap lane until the STORE's last part is read
        client.submit(store)
        client.submit(waiting)
        time.sleep(1.0)  # both lanes busy
        os.kill(old_pid, signal.SIGKILL)
        results, _ = finish_order(sup, client, [store, waiting], submit=False)
        for res in results:
            assert not res.ok and res.error == f"rank 0: transfer[0] pid {old_pid} died", res.error
        assert client.pending == 0
        sup.start(0, per_block_s=0.1)
        wait_ready(client)
        want = device_blocks(sup.devices[0], [3])
        out, store2, load = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [3], [5]),
                                      plan(CopyKind.STORE, [5], [], [key(5, "after")]),
                                      plan(CopyKind.LOAD, [], [6], [key(5, "after")]))
        assert out.ok and store2.ok and load.ok, (out.error, store2.error, load.error)
        assert same(sup.hosts[0].array[6, 0, 0], want[0][0])
    finally:
        codes = sup.close()  # asserts the run left nothing in /dev/shm
    assert codes == {0: 0}, codes


def test_a_storage_lane_that_fails_drops_its_queue_frees_its_holds_and_reraises_in_the_loop():
    holds, ran, gate = HostHolds(), [], threading.Event()

    def run(msg, hold):
        ran.append(msg.task_id)
        gate.wait(10)
        raise EngineGone(0, "the engine closed the done channel")

    lane = StorageLane(run, "test-storage")
    try:
        for i in range(3):
            lane.submit(TaskMsg(i, int(CopyKind.LOAD)), holds.hold([i], writes=True))
        waiter = threading.Thread(target=holds.wait, args=([0, 1, 2], False, lambda: None, 0.05))
        waiter.start()
        gate.set()
        waiter.join(10)
        assert not waiter.is_alive(), "a swap still waits for holds of tasks the lane dropped"
        assert ran == [0], "the lane ran tasks after its error"
        with pytest.raises(EngineGone):
            lane.drain(lambda: None, 0.05)
    finally:
        lane.close()


def test_lookups_and_loads_go_ahead_of_queued_stores_in_their_own_order():
    """A request waits for its LOOKUP and LOAD, nobody for a STORE: behind a backlog of STOREs
    they run first, among themselves in the order sent."""
    holds, ran, gate = HostHolds(), [], threading.Event()

    def run(msg, hold):
        gate.wait(10)
        ran.append(msg.task_id)
        hold.release()

    lane = StorageLane(run, "test-storage")
    try:
        kinds = [CopyKind.STORE, CopyKind.STORE, CopyKind.STORE, CopyKind.LOOKUP, CopyKind.STORE, CopyKind.LOAD]
        for i, kind in enumerate(kinds):
            lane.submit(TaskMsg(i, int(kind)), holds.hold([i], writes=kind == CopyKind.LOAD))
            if i == 0:  # the first STORE is running when the others come
                while not lane._busy:
                    threading.Event().wait(0.001)
        gate.set()
        lane.drain(lambda: None, 0.05)
        assert ran == [0, 3, 5, 1, 2, 4]
    finally:
        lane.close()


def test_a_lookup_goes_ahead_of_queued_loads_and_runs_between_the_parts_of_the_running_task():
    """An admission waits for its LOOKUP: behind a LOAD or STORE of many blocks on a busy machine
    it timed out (beside a CPU hog). It goes ahead of the queued LOADs and runs at the running
    task's next part boundary."""
    holds, ran, gate, started = HostHolds(), [], threading.Event(), threading.Event()
    lane = StorageLane(lambda msg, hold: None, "test-storage")

    def run(msg, hold):
        if msg.task_id == 0:  # a long LOAD: its first part, then the lookups that came, then the rest
            started.set()
            gate.wait(10)
            ran.append("0: part 1")
            lane.run_waiting_lookups()
            ran.append("0: part 2")
        else:
            ran.append(msg.task_id)
        hold.release()

    lane._run = run
    try:
        lane.submit(TaskMsg(0, int(CopyKind.LOAD)), holds.hold([0], writes=True))
        assert started.wait(10)
        for i, kind in enumerate([CopyKind.STORE, CopyKind.LOAD, CopyKind.LOOKUP, CopyKind.LOOKUP], 1):
            lane.submit(TaskMsg(i, int(kind)), holds.hold([i] if kind != CopyKind.LOOKUP else [], writes=False))
        gate.set()
        lane.drain(lambda: None, 0.05)
        assert ran == ["0: part 1", 3, 4, "0: part 2", 2, 1]
    finally:
        gate.set()
        lane.close()


def test_the_storage_lane_cuts_the_gil_switch_interval_so_a_woken_swap_waits_a_fraction_of_5_ms():
    """A woken thread waits for the GIL up to the switch interval (CPython's default: 5 ms)
    while another thread runs Python: starting the storage lane must cut it. (What that
    buys in wall time, 6.8 -> 0.3 ms median here, is a measurement, not a test: a loaded
    machine's scheduler adds its own delays.)"""
    stop, previous = threading.Event(), sys.getswitchinterval()
    sys.setswitchinterval(0.005)

    def run(msg, hold):  # pure Python until stopped: never gives the GIL up by itself
        while not stop.is_set():
            pass
        hold.release()

    lane = StorageLane(run, "test-storage")
    try:
        lane.submit(TaskMsg(1, int(CopyKind.STORE)), HostHolds().hold([0], writes=False))
        assert sys.getswitchinterval() <= GIL_SWITCH_S < 0.005 / 10
    finally:
        stop.set()
        lane.close()
        sys.setswitchinterval(previous)


def storage_thread_sees(probe, kinds=(CopyKind.STORE,), one_by_one=False):
    """What ``probe(tid)`` returns on a storage lane's thread as it runs each task of ``kinds``
    (in the order sent: the lane runs LOOKUPs and LOADs ahead of queued STOREs)."""
    seen = {}

    def run(msg, hold):
        seen[msg.task_id] = probe(threading.get_native_id())
        hold.release()

    lane = StorageLane(run, "test-storage")
    try:
        for i, kind in enumerate(kinds):
            lane.submit(TaskMsg(i + 1, int(kind)), HostHolds().hold([i], writes=kind == CopyKind.LOAD))
            if one_by_one:  # each task runs before the next is sent: the order is the one given
                lane.drain(lambda: None, 0.05)
        lane.drain(lambda: None, 0.05)
    finally:
        lane.close()
    return [seen[i + 1] for i in range(len(kinds))]


def may_leave_sched_idle() -> bool:
    """Whether this process may switch a thread from SCHED_IDLE back (CAP_SYS_NICE: root here)."""
    result = []

    def probe():
        tid = threading.get_native_id()
        normal = os.sched_getscheduler(tid)
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        try:
            os.sched_setscheduler(tid, normal, os.sched_param(0))
            result.append(True)
        except PermissionError:
            result.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return result[0]


def test_stores_run_under_sched_idle_lookups_and_loads_do_not_and_the_loop_thread_never_does():
    """On two cores, a busy storage thread beside the loop thread and the engine left a woken
    swap or engine waiting for a core (bench_swap's lane_p99_ratio 4-7; at nice 19 still 2-3% of
    the swaps beside a STORE over 1 ms): under SCHED_IDLE a STORE gives way at once. A request
    waits for its LOOKUP and LOAD: starved beside two busy engines, lookups timed out (CI)."""
    if not may_leave_sched_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE): every storage task runs low")
    mine = os.sched_getscheduler(threading.get_native_id())
    kinds = (CopyKind.STORE, CopyKind.LOAD, CopyKind.STORE, CopyKind.LOOKUP, CopyKind.STORE)
    # one by one: a STORE with a LOOKUP or LOAD behind it hurries (the test below)
    assert storage_thread_sees(os.sched_getscheduler, kinds, one_by_one=True) == [
        os.SCHED_IDLE, mine, os.SCHED_IDLE, mine, os.SCHED_IDLE] and mine != os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) == mine, "the loop thread went SCHED_IDLE too"


def test_a_store_hurries_while_a_lookup_waits_behind_it_or_while_stores_pile_up():
    """A STORE under SCHED_IDLE on a machine whose cores are all busy barely runs: a LOOKUP
    queued behind it would wait that out (a priority inversion: lookups timed out beside a CPU
    hog), and STOREs queued past ``urgent_store_blocks`` would soon be skipped by the engine.
    Either way the running STORE takes the thread's own priority at once."""
    if not may_leave_sched_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE): every storage task runs low")
    mine = os.sched_getscheduler(threading.get_native_id())
    holds, started, gate = HostHolds(), threading.Event(), threading.Event()

    def run(msg, hold):
        if msg.kind == CopyKind.STORE:
            started.set()
            gate.wait(10)
        hold.release()

    def store(i, nblocks):
        return TaskMsg(i, int(CopyKind.STORE), np.arange(nblocks, dtype=np.int32), np.zeros(0, np.int32), ())

    lane = StorageLane(run, "test-storage", urgent_store_blocks=4)
    try:
        for behind in (TaskMsg(2, int(CopyKind.LOOKUP)), store(4, 3)):
            started.clear()
            gate.clear()
            lane.submit(store(1, 1), holds.hold([0], writes=False))
            assert started.wait(10)
            policy = lambda: os.sched_getscheduler(lane._thread.native_id)  # noqa: E731
            assert policy() == os.SCHED_IDLE  # alone: nobody waits for it
            lane.submit(behind, holds.hold([1], writes=False))
            assert policy() == mine, f"the STORE stayed under SCHED_IDLE with {CopyKind(behind.kind).name} behind"
            gate.set()
            lane.drain(lambda: None, 0.05)
    finally:
        gate.set()
        lane.close()


def test_where_sched_idle_is_refused_the_storage_thread_is_niced(monkeypatch):
    def refuse(*args):
        raise PermissionError("sched_setscheduler refused")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = storage_thread_sees(lambda tid: os.getpriority(os.PRIO_PROCESS, tid), (CopyKind.LOAD, CopyKind.STORE,
                                                                                  CopyKind.LOAD), one_by_one=True)
    assert seen == [mine, min(19, mine + STORAGE_NICE), min(19, mine + STORAGE_NICE)] and STORAGE_NICE > 0
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine, "the loop thread was niced too"
