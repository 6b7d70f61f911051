"""The worker protocol on the wire, the workload reader and the metrics registry."""
from __future__ import annotations

import json
import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client import generate_latest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.engine import protocol
from fastkv.engine.engine import read_workload
from fastkv.engine.metrics import EngineMetrics
from fastkv.ipc import decode, encode
from fastkv.sched import Request, Scheduler
from fastkv.sched.output import SeqWork, StepOutput, StepPlan


def _plan(samples: list[bool]) -> StepPlan:
    return StepPlan(7, [SeqWork(10 + i, np.arange(i + 1) + 3, 4 * i, np.arange(i + 2) + 1, s)
                        for i, s in enumerate(samples)])


@pytest.mark.parametrize("samples", [[True, False, True], [True, True], [False], []])
def test_plan_round_trip(samples):
    plan = _plan(samples)
    msg = decode(encode(protocol.plan_to_msg(plan, release=[3, 4])))
    if all(samples):
        assert len(msg.sample) == 0, "an all-sample step should send no flags"
    got = protocol.msg_to_plan(msg)
    assert got.step_id == plan.step_id and protocol.released(msg) == [3, 4]
    assert len(got.seqs) == len(plan.seqs)
    for a, b in zip(got.seqs, plan.seqs, strict=True):
        assert (a.request_id, a.start_pos, a.sample) == (b.request_id, b.start_pos, b.sample)
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.block_table, b.block_table)


def test_output_round_trip():
    out = StepOutput(5, {11: 40, 12: 0}, 0.25)
    msg = decode(encode(protocol.output_to_msg(out, 9)))
    assert msg.num_batched_tokens == 9 and msg.error == ""
    assert protocol.msg_to_output(msg) == out
    err = decode(encode(protocol.error_msg(5, "worker1 step 5: boom")))
    assert err.error == "worker1 step 5: boom" and len(err.tokens) == 0


def _write(tmp_path, rows) -> str:
    path = tmp_path / "workload.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_workload_sorted_by_arrival(tmp_path):
    rows = [{"id": "b", "arrival_s": 1.5, "prompt": [1, 2], "max_new_tokens": 3, "preemption": "offload"},
            {"id": "a", "arrival_s": 0, "prompt": [5], "max_new_tokens": 1, "preemption": None}]
    items = read_workload(_write(tmp_path, rows))
    assert [it.id for it in items] == ["a", "b"] and items[1].preemption == "offload"


@pytest.mark.parametrize("row, word", [
    ({"id": "a", "prompt": [], "max_new_tokens": 1}, "prompt"),
    ({"id": "a", "prompt": [1, -2], "max_new_tokens": 1}, "prompt"),
    ({"id": "a", "prompt": [1], "max_new_tokens": 0}, "max_new_tokens"),
    ({"id": "a", "prompt": [1], "max_new_tokens": 1, "arrival_s": -1}, "arrival_s"),
    ({"id": "a", "prompt": [1], "max_new_tokens": 1, "preemption": "swap"}, "preemption"),
    ({"id": 3, "prompt": [1], "max_new_tokens": 1}, "'id'"),
    ("{not json", "not JSON"),
])
def test_workload_errors_name_line_and_field(tmp_path, row, word):
    path = _write(tmp_path, [{"id": "ok", "prompt": [1], "max_new_tokens": 1}, row])
    with pytest.raises(ValueError, match=f"workload.jsonl:2: .*{word}"):
        read_workload(path)


def test_duplicate_ids_are_refused(tmp_path):
    row = {"id": "x", "prompt": [1], "max_new_tokens": 1}
    with pytest.raises(ValueError, match="unique"):
        read_workload(_write(tmp_path, [row, row]))


def _metrics() -> EngineMetrics:
    cache = CacheManager(CacheConfig(num_device_blocks=8, num_host_blocks=4, block_size=4))
    sched = Scheduler(cache)
    sched.add_request(Request(0, np.arange(6), 2))
    sched.step()
    return EngineMetrics(sched)


def test_metrics_registry_and_summary():
    m = _metrics()
    m.observe_step(0.002, 3)
    m.observe_step(0.004, 1)
    m.observe_copy("swap_out", True, 4096, 0.001)
    m.observe_copy("load", False, 0, 0.5)
    text = generate_latest(m.registry).decode()
    for line in ('fastkv_hit_tokens_total{tier="device"}', 'fastkv_blocks{state="allocated",tier="device"} 2.0',
                 'fastkv_preemptions_total{mode="offload"} 0.0', "fastkv_step_seconds_count 2.0",
                 'fastkv_copy_bytes_total{kind="swap_out"} 4096.0', 'fastkv_copy_failures_total{kind="load"} 1.0',
                 'fastkv_requests{state="running"} 1.0', "fastkv_generated_tokens_total 4.0"):
        assert line in text, f"{line!r} not in\n{text}"
    s = m.summary()
    assert set(s) >= {"recomputed_tokens", "preemptions", "hit_ratio", "copy_gbps", "step_ms_p50", "step_ms_p99",
                      "task_ms_p50"}
    assert s["step_ms_p50"] == pytest.approx(3.0) and s["copy_gbps"] == pytest.approx(4096 / 0.001 / 1e9)
    assert s["copy_tasks"] == {"swap_out": 1}
    assert EngineMetrics(m.scheduler).registry is not m.registry, "each engine has its own registry"


def test_metrics_endpoint():
    m = _metrics()
    assert m.serve(0) == 0, "port 0 means off"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        assert m.serve(port) == port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "fastkv_blocks" in body and "fastkv_hit_tokens_total" in body
    finally:
        m.close()
    with pytest.raises(ValueError, match="port"):
        m.serve(70000)
