"""The transfer process's loop in this process: fences, stale tasks, stop, engine gone."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.ipc import Peer, TaskMsg
from fastkv.ipc.native import A
from fastkv.ipc.ring import HEADER, OFF_TAIL
from fastkv.run import attach_transfer
from fastkv.transfer.executor import TaskExecutor
from fastkv.transfer.process import TransferLoop
from fastkv.transfer.protocol import FENCE, FENCE_ID, fence_for
from tests.optional import require_paddle
from tests.transfer.helpers import SlowStore, Supervisor, key, plan, pump

require_paddle()


def close_all(*parts) -> None:
    """Closes what a test opened, in order, skipping what it never got to open."""
    for part in parts:
        if part is not None:
            part.close()


def test_loop_drops_everything_before_its_fence_then_serves_and_stops():
    sup = Supervisor(layout=KVLayout(1, 1, 16, 16, "float32", tp_size=1), num_device_blocks=4, num_host_blocks=4)
    ends = executor = loop = None
    try:
        client = sup.engine(kill_late=False)
        ends = attach_transfer(sup.ns, sup.spec, 0)
        executor = TaskExecutor(sup.spec, 0)
        loop = TransferLoop(sup.spec, 0, ends, executor)
        # leftovers of a predecessor: a task, the fence it got, and a malformed fence
        sup.devices[0].k_arrays[0][3] = 7.0
        sup.ends.tasks[0].send_many([fence_for(Peer("transfer", 0, 1, 1), "0"), TaskMsg(900, int(CopyKind.SWAP_IN),
                                     np.array([0], np.int32), np.array([3], np.int32)),
                                     TaskMsg(FENCE_ID, FENCE, keys=(b"garbage",))])
        assert client.ready()
        p = plan(CopyKind.SWAP_OUT, [3], [1])
        client.submit(p)
        msgs = ends.task.recv_many(16, timeout=1)
        assert len(msgs) == 5
        for m in msgs:
            loop.handle(m)
        assert (loop.dropped, loop.executed, loop.fenced) == (1, 1, True)
        assert (sup.devices[0].k_arrays[0][3] == 7.0).all(), "the predecessor's task ran"
        res = pump(sup, client, [p.plan_id])[p.plan_id]
        assert res.ok and (sup.hosts[0].array[1, 0, 0] == 7.0).all()
        beat = sup.signals["transfer0.beat"]
        assert beat > 0
        sup.signals["stop"] = 1
        assert loop.run() == 0
        assert sup.signals["transfer0.beat"] == beat, "stop set: the loop waited for a task before returning"
        sup.signals["stop"] = 0
        sup.ends.tasks[0].close()  # the engine is done: its end closed
        assert loop.run() == 0
    finally:
        close_all(loop, ends, executor, sup)


@pytest.mark.parametrize("corrupt", ["frame", "payload"])
def test_a_corrupt_task_fails_alone_and_the_tasks_around_it_run(corrupt):
    """One damaged task message (a torn ring frame, or bytes that no longer decode) fails
    just that task, acknowledged as bad by the process; the tasks before and after it run."""
    sup = Supervisor(layout=KVLayout(1, 1, 16, 16, "float32", tp_size=1), num_device_blocks=4, num_host_blocks=4)
    ends = executor = loop = None
    try:
        client = sup.engine(kill_late=False)
        ends = attach_transfer(sup.ns, sup.spec, 0)
        executor = TaskExecutor(sup.spec, 0)
        loop = TransferLoop(sup.spec, 0, ends, executor)
        assert client.ready()  # the fence is the first frame
        plans = [plan(CopyKind.SWAP_OUT, [i], [i]) for i in range(3)]
        for p in plans:
            client.submit(p)
        ring = sup.ends.tasks[0].ring
        slot = HEADER + (A.load(ring.hdr + OFF_TAIL) + 2) % ring.nslots * ring.slot_size  # after the fence and task 1
        ring._mm[slot + {"frame": 4, "payload": 8}[corrupt]] ^= 0xFF  # the second task's seq or type id
        server = threading.Thread(target=loop.run)
        server.start()
        try:
            got = pump(sup, client, [p.plan_id for p in plans], timeout=10)
        finally:
            sup.signals["stop"] = 1
            server.join(10)
        first, bad, last = (got[p.plan_id] for p in plans)
        assert first.ok and last.ok, (first.error, last.error)
        assert not bad.ok and bad.error.startswith("rank 0: bad task message: "), bad.error
        assert loop.executed == 2
        assert ring.dropped == (corrupt == "frame")
    finally:
        close_all(loop, ends, executor, sup)


def test_a_long_store_on_slow_storage_keeps_the_heartbeat(tmp_path):
    """A STORE that takes longer than dead_after_s on a backend that is slow but making
    progress beats as it goes: the supervisor's rule never finds the rank silent."""
    sup = Supervisor(layout=KVLayout(1, 1, 16, 16, "float32", tp_size=1), num_device_blocks=4, num_host_blocks=64,
                     storage_url=f"lmdb://{tmp_path}")
    ends = executor = loop = None
    try:
        client = sup.engine(kill_late=False)
        ends = attach_transfer(sup.ns, sup.spec, 0)
        executor = TaskExecutor(sup.spec, 0)
        executor.store = SlowStore(executor.store, per_block_s=0.05)
        loop = TransferLoop(sup.spec, 0, ends, executor)
        assert client.ready()
        n = int(1.5 * sup.spec.dead_after_s / 0.05)
        store = plan(CopyKind.STORE, range(n), [], [key(i, "slow") for i in range(n)])
        silences, done = [], threading.Event()

        engine_spins: list[bool] = []  # the engine's spin for acks, sampled well inside the STORE

        def watch() -> None:  # the supervisor's liveness rule, sampled
            while not done.is_set():
                silences.append(time.monotonic_ns() - sup.signals["transfer0.beat"])
                if 0.3 < time.monotonic() - t0 < sup.spec.dead_after_s:  # the STORE takes 1.5x that
                    engine_spins.append(sup.ends.inbox.bell.spin.enabled)
                time.sleep(0.02)

        server, watcher = threading.Thread(target=loop.run), threading.Thread(target=watch)
        t0 = time.monotonic()
        server.start()
        watcher.start()
        try:
            client.submit(store)
            res = pump(sup, client, [store.plan_id], timeout=30)[store.plan_id]
            took = time.monotonic() - t0
        finally:
            sup.signals["stop"] = 1
            done.set()
            server.join(10)
            watcher.join(10)
        assert res.ok, res.error
        assert took > sup.spec.dead_after_s, took
        assert max(silences) < sup.spec.dead_after_s * 1e9 / 2, f"heartbeat silent for {max(silences) / 1e9:.2f} s"
        # the engine does not spin while the low-priority storage thread needs a core (fastkv.transfer.client)
        assert engine_spins and not any(engine_spins), engine_spins
        # the loop spins for tasks holding the GIL: its storage thread cannot take it and stall there
        assert ends.task.ring.data_bell.spin.keep_gil and ends.task.ring.data_bell.spin.enabled
        assert sup.ends.inbox.bell.spin.enabled, "the engine spins for acks again once the STORE is done"
    finally:
        close_all(loop, ends, executor, sup)
