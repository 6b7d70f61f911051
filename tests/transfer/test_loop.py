"""The transfer process's loop in this process: fences, stale tasks, stop, engine gone."""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.ipc import Peer, TaskMsg
from fastkv.run import attach_transfer
from fastkv.transfer.executor import TaskExecutor
from fastkv.transfer.process import TransferLoop
from fastkv.transfer.protocol import FENCE, FENCE_ID, fence_for
from tests.transfer.helpers import Supervisor, plan, pump

pytest.importorskip("paddle")


def test_loop_drops_everything_before_its_fence_then_serves_and_stops():
    sup = Supervisor(layout=KVLayout(1, 1, 16, 16, "float32", tp_size=1), num_device_blocks=4, num_host_blocks=4)
    ends = executor = None
    try:
        client = sup.engine(kill_late=False)
        ends = attach_transfer(sup.ns, sup.spec, 0)
        executor = TaskExecutor(sup.spec, 0)
        loop = TransferLoop(sup.spec, 0, ends, executor)
        # leftovers of a predecessor: a task, the fence it got, and a malformed fence
        sup.devices[0].k_arrays[0][3] = 7.0
        sup.ends.tasks[0].send_many([fence_for(Peer("transfer", 0, 1, 1)), TaskMsg(900, int(CopyKind.SWAP_IN),
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
        if ends is not None:
            ends.close()
        if executor is not None:
            executor.close()
        sup.close()
