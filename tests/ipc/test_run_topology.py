import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.ipc import DoneMsg, Namespace, OutputMsg, PlanMsg, TaskMsg
from fastkv.run import RunSpec, attach_engine, attach_transfer, attach_worker, create_run, signal_names


def _spec(run_id: str, tp: int = 2) -> RunSpec:
    return RunSpec(run_id=run_id, layout=KVLayout(2, 2, 16, 16, "float32", tp_size=tp), num_device_blocks=8,
                   num_host_blocks=4, scheduler={"preemption": "offload"})


def test_spec_json_round_trip_and_validation():
    spec = _spec("abc")
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="unknown fields"):
        RunSpec.from_json('{"run_id": "x", "bogus": 1}')
    with pytest.raises(ValueError, match="num_device_blocks"):
        RunSpec(run_id="x", layout=KVLayout(1, 1, 16, 16), num_device_blocks=0, num_host_blocks=0)


def test_topology_carries_every_message_kind():
    with Namespace.create() as ns:
        spec = _spec(ns.run_id)
        create_run(ns, spec)
        eng = attach_engine(ns, spec)
        trs = [attach_transfer(ns, spec, r) for r in range(2)]
        wks = [attach_worker(ns, spec, r) for r in range(2)]
        try:
            for r in range(2):
                eng.tasks[r].send(TaskMsg(7, 1, np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32)))
                assert trs[r].task.recv(timeout=1).task_id == 7
                trs[r].done.send(DoneMsg(7, r, True, nbytes=10))
                eng.plans[r].send(PlanMsg(1))
                assert wks[r].plan.recv(timeout=1).step_id == 1
            assert wks[1].output is None
            wks[0].output.send(OutputMsg(1))
            got = eng.inbox.recv_many(16, timeout=1)
            while len(got) < 3:
                got += eng.inbox.recv_many(16, timeout=1)
            assert sorted(type(m).__name__ for m in got) == ["DoneMsg", "DoneMsg", "OutputMsg"]
            eng.signals["worker0.beat"] = 5
            assert wks[0].signals["worker0.beat"] == 5
            assert set(eng.signals.snapshot()) == set(signal_names(2))
            with pytest.raises(ValueError, match="rank"):
                attach_worker(ns, spec, 2)
        finally:
            for ends in (eng, *trs, *wks):
                ends.close()
