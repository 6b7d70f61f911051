"""Copy plans travel as task messages and come back as the same plan."""
import numpy as np
import pytest

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.ipc import TaskMsg, decode, encode
from fastkv.transfer.protocol import task_msg, task_plan


def test_copy_plan_conversion():
    plan = CopyPlan(7, CopyKind.STORE, np.array([3, 4], np.int32), keys=(b"a" * 32, b"b" * 32))
    msg = task_msg(plan)
    back = task_plan(decode(encode(msg)))
    assert back.plan_id == 7 and back.kind is CopyKind.STORE and back.keys == plan.keys
    assert np.array_equal(back.src, plan.src) and len(back.dst) == 0
    bad = TaskMsg(8, CopyKind.SWAP_OUT, np.array([1, 2], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="as many src as dst"):
        task_plan(decode(encode(bad)))


def test_a_task_of_an_unknown_kind_names_it():
    with pytest.raises(ValueError, match="^unknown task kind 42$"):
        task_plan(decode(encode(TaskMsg(9, 42))))
