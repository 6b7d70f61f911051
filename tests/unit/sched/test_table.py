"""The scheduler's parts: the request table files each request by its state and is the only
caller of ``move``; the copy outbox hands plans out once and completes each once."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from fastkv.cache.plan import ClearTask
from fastkv.sched.outbox import CopyOutbox
from fastkv.sched.queues import QueuePolicy
from fastkv.sched.request import Request, RequestState
from fastkv.sched.stats import SchedulerStats
from fastkv.sched.table import RequestTable

S = RequestState
SCHED = Path(__file__).resolve().parents[3] / "fastkv" / "sched"


def where(table: RequestTable, req: Request) -> list[str]:
    places = [name for name in ("loading", "running", "offloading") if req.request_id in getattr(table, name)]
    return places + ["waiting"] * (req in table.waiting)


def test_only_the_table_moves_requests():
    callers = set()
    for path in SCHED.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "move":
                callers.add(path.name)
    assert callers == {"table.py"}


def test_each_transition_files_the_request_by_its_new_state():
    stats = SchedulerStats()
    table = RequestTable(QueuePolicy.FCFS, 4.0, stats)
    req = Request(7, np.arange(20), max_new_tokens=4)
    table.add(req)
    assert (req.state, where(table, req), req.arrival_seq) == (S.WAITING, ["waiting"], 0)
    table.admit(req)
    table.start_loading(req, 16, S.WAITING)
    assert (req.state, where(table, req), req.load_target, req.watermark) == (S.LOADING, ["loading"], 16, 4.0)
    table.start_running(req, 16, S.LOADING)
    assert (req.state, where(table, req), req.num_computed_tokens) == (S.RUNNING, ["running"], 16)
    req.watermark = 1.0
    table.preempt(req)
    assert (req.state, where(table, req), req.num_preemptions) == (S.PREEMPTED, [], 1)
    table.start_offloading(req, 3)
    assert (req.state, where(table, req), req.relief_blocks) == (S.OFFLOADING, ["offloading"], 3)
    table.offloaded(req)
    assert (req.state, where(table, req), req.relief_blocks) == (S.OFFLOADED, ["waiting"], 0)
    table.to_waiting(req, S.OFFLOADED)
    assert (req.state, where(table, req), req.num_computed_tokens, req.num_slotted) == (S.WAITING, ["waiting"], 0, 0)
    table.finish(req, S.FINISHED_ABORTED, now=5.0)
    assert (req.state, where(table, req), req.finish_time) == (S.FINISHED_ABORTED, [], 5.0)
    assert 7 not in table.requests and table.take_finished() == [req] and table.finished == []
    assert (stats.admitted, stats.finished, stats.aborted) == (1, 1, 1)


def test_a_prefilled_request_is_admitted_straight_into_loading():
    table = RequestTable(QueuePolicy.FCFS, 2.0, SchedulerStats())
    first, prefilled = Request(1, np.arange(4), max_new_tokens=2), Request(2, np.arange(4), max_new_tokens=2)
    table.add(first)
    table.admit_prefilled(prefilled)
    table.start_loading(prefilled, 3, S.WAITING)
    assert where(table, prefilled) == ["loading"] and prefilled.arrival_seq == 1 and prefilled.admit_seq == 0
    table.load_failed(prefilled)
    assert (prefilled.state, where(table, prefilled)) == (S.WAITING, ["waiting"])
    assert [r.request_id for r in table.waiting] == [1, 2]  # it keeps its place in arrival order


def test_the_outbox_hands_each_plan_out_once_and_completes_it_once():
    box = CopyOutbox()
    plans = [ClearTask(plan_id=i) for i in (3, 4)]
    box.emit(plans)
    assert box and box.plan_ids() == [3, 4] and not box.in_flight
    out = box.hand_out()
    assert [id(p) for p in out] == [id(p) for p in plans] and box.hand_out() == [] and list(box.in_flight) == [3, 4]
    assert box.complete(3) is plans[0] and box.complete(3) is None and box.complete("3") is None
    assert box.plan_ids() == [4]
    box.complete(4)
    assert not box
